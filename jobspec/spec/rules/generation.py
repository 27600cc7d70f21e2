"""`training.eval_generate`: answers generated at evaluation need a model that generates text (a
causal-lm), text to prompt it with (file data and its tokenizer; a prompts file, or evaluation
records that have a prompt), and room for a prompt within `data.max_length` beside
`max_new_tokens`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec import tasks
from jobspec.data.formats import named_format
from jobspec.data.records import RECORD_KINDS
from jobspec.errors import SpecIssue
from jobspec.spec.rules.base import exists, local_path
from jobspec.spec.types import JobSpecData
from jobspec.tasks.base import NEXT_TOKENS

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

FIELD = ("training", "eval_generate")
PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".txt")


def eval_generate_issues(r: ResolvedSpec) -> list[SpecIssue]:
    generate = r.spec["training"].get("eval_generate")
    if not generate:
        return []
    task, data = r.spec["model"]["task"], r.spec["data"]
    if tasks.get(task).labels != NEXT_TOKENS:
        return [r.issue(FIELD,
                        f"a {task} model does not generate text; generation at evaluation needs "
                               "`model.task: causal-lm`", "remove training.eval_generate",
                        code="eval-generate-task")]
    if data.get("synthetic") is not None:
        return [r.issue(FIELD, "synthetic token ids have no text to prompt with",
                        "train on file data with a "
                        "tokenizer (data.train, data.tokenizer), or remove training.eval_generate",
                        code="eval-generate-synthetic")]
    issues = []
    if r.spec["memory"]["sequence_parallel"] > 1:
        issues.append(r.issue(FIELD,
                              "generation runs whole sequences on each rank; Ulysses sequence "
                              "parallelism shards them between ranks",
                              "remove training.eval_generate, or set "
                              "memory.sequence_parallel: 1",
                              code="eval-generate-sequence-parallel"))
    prompts = generate["prompts"]
    if isinstance(prompts, str):
        path = local_path(r, (*FIELD, "prompts"))
        if not exists(path, file=True):
            issues.append(r.issue((*FIELD, "prompts"), f"prompts file {path} does not exist",
                                  "give a .jsonl file of chat or prompt records, a .txt file of "
                                  "one prompt per line, or a number of evaluation records",
                                  code="eval-generate-prompts-file"))
        elif path.suffix.lower() not in PROMPT_FILE_SUFFIXES:
            issues.append(r.issue((*FIELD, "prompts"),
                                  f"prompts file {path.name} is neither JSON lines nor text",
                                  "use a .jsonl file of chat or prompt records, or a .txt file of "
                                  "one prompt per line", code="eval-generate-prompts-file"))
    elif not data.get("eval"):
        issues.append(r.issue((*FIELD, "prompts"),
                              f"the first {prompts} evaluation records are the prompts, and "
                              "the job has no evaluation data",
                              "set data.eval, or give a prompts file "
                              "(training.eval_generate.prompts: prompts.jsonl)",
                              code="eval-generate-no-eval"))
    elif text_records(data):
        issues.append(r.issue((*FIELD, "prompts"),
                              "text records have no prompt and answer to generate from",
                              "give a prompts file, or evaluate on chat or prompt/completion "
                              "records",
                              code="eval-generate-text-records"))
    if generate["max_new_tokens"] >= data["max_length"]:
        issues.append(r.issue((*FIELD, "max_new_tokens"),
                              f"{generate['max_new_tokens']} new tokens leave no room "
                              f"for a prompt within data.max_length ({data['max_length']})",
                              f"use fewer than {data['max_length']} (prompts keep their last "
                              "max_length - max_new_tokens tokens)", code="eval-generate-length"))
    return issues


def text_records(data: JobSpecData) -> bool:
    """Records with no prompt and answer, known from the spec alone: `data.records` names a kind
    that is not rendered (text), or `data.format` one that holds documents (a text corpus)."""
    named = named_format(data["format"])
    return (data["records"] != "auto" and not RECORD_KINDS[data["records"]].rendered) or \
        (named is not None and not named.holds_records)
