"""Answers generated at every evaluation (`training.eval_generate`), so a reviewer reads what the
model says, not only its loss.

The prompts are fixed for the run: the first N evaluation records, or the records of a prompts file,
rendered with the job's chat template up to their last user turn with the assistant header after it
(`add_generation_prompt`), the assistant turn that followed kept as the reference; without a
template (prompt/completion records of a tokenizer that has none) the prompt text as training saw
it. A prompt keeps its last `data.max_length - max_new_tokens` tokens.

At each evaluation (train/evaluation.Evaluator: every `training.eval_every` steps and at the last
step) every rank generates its share
(prompt i on rank i mod world), `micro_batch_size` prompts per `generate` call, left-padded. Under
ZeRO-3 each rank holds a slice of every weight: all ranks make the same number of calls (a rank
without prompts of its own repeats one and drops the answer) with `synced_gpus=True`, so every
forward is collective and DeepSpeed gathers the partitioned weights as the layers run; and every
rank stops at the same token (`AllRanksEnded`), so that none runs as transformers' idle
`synced_gpus` peer (a path DeepSpeed users report hangs with ZeRO-3, deepspeedai/DeepSpeed#8262), at
no extra cost: `synced_gpus` runs every rank to the slowest one's end anyway. LoRA/QLoRA
adapters stay active (PEFT's `generate`). Generation stops at the tokenizer's EOS or the template's
end-of-turn token (model/chat_turns.py), else after `max_new_tokens`: the cost's bound.

Training is not disturbed: the engine goes back to training mode, and torch's (CPU and the rank's
GPU), Python's and NumPy's random states are restored, so the losses with generation on are
bit-identical to those with it off (sampling at `temperature > 0` draws from its own seed: the same
at every evaluation, so answers change with the weights only).

Rank 0 gathers the answers and records them: `generations.jsonl` in the run directory (a step
already there is not written twice), the step's rows of the run's MLflow table through the metric
sink (tracking/generations.py: the question, the reference, the answer and the system prompt in
columns of their own), `eval/exact_match` (answers equal to their reference, whitespace aside,
over the prompts that have one) and `time/eval_generate_s`, a progress line, and the first answer in
summary.json (`generation`) for the closing summary.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from jobspec import rundir
from jobspec.data.chat_render import generation_prompt_ids
from jobspec.data.formats import split_format
from jobspec.data.record_checks import load_dataset
from jobspec.data.records import record_kind
from jobspec.errors import first_line, spec_error
from jobspec.spec.types import JobSpec, JobSpecData, JobSpecTrainingEvalGenerate
from jobspec.train.metrics import any_rank

FIELD = ("training", "eval_generate")
STOP, LENGTH = "stop", "length"   # an end token ended the answer; max_new_tokens did
SHOWN_CHARS = 120                 # the progress line's and the closing summary's excerpt


@dataclass
class Prompt:
    # the conversation up to the last user turn (that turn alone when it is all)
    text: str
    ids: list[int]          # the rendered prompt's token ids, as the model gets them
    reference: str | None   # the answer the record holds after it, if any
    user: str = ""          # the last user turn: the question the answer is to
    system: str | None = None    # the system prompt(s), kept apart: every prompt may repeat it
    context: str | None = None   # the turns between the system prompt and the last user turn


@dataclass
class Answer:
    text: str
    tokens: int             # new tokens, the end token included
    stop_reason: str        # STOP or LENGTH


# --- the prompts ---------------------------------------------------------------------------------

def conversation(record, data: JobSpecData) -> tuple[list[dict], str | None]:
    """(messages up to the last user turn, the assistant answer after it or None) of one record: a
    chat record, a prompt (/completion) record, or a plain string."""
    if isinstance(record, str):
        return [{"role": "user", "content": record}], None
    if not isinstance(record, dict):
        raise ValueError("a prompt is a chat record, a prompt record or a string, not "
                         f"{type(record).__name__}")
    # (a table of mixed records has it null elsewhere)
    if record.get(data["messages_field"]) is not None:
        messages = [{"role": m["role"], "content": m["content"]}
                    for m in record[data["messages_field"]] or []
                    if isinstance(m, dict) and isinstance(m.get("content"), str)]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError("the conversation has no user turn to answer")
        last = users[-1]
        after = messages[last + 1] if last + 1 < len(messages) else None
        reference = after["content"] if after is not None and after["role"] == "assistant" else None
        return messages[:last + 1], reference
    prompt = record.get(data["prompt_field"])
    if not isinstance(prompt, str):
        raise ValueError(f"the record has neither {data['messages_field']!r} nor a text "
                         f"{data['prompt_field']!r}")
    completion = record.get(data["completion_field"])
    return [{"role": "user", "content": prompt}], completion if isinstance(completion, str) \
        else None


def shown_text(messages: list[dict]) -> str:
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def prompt_parts(messages: list[dict]) -> dict:
    """The columns a reviewer reads a prompt by: the last user turn (`user`), the system prompt
    (`system`) and the turns between them (`context`, one `role: content` line each)."""
    system = [m["content"] for m in messages[:-1] if m["role"] == "system"]
    between = [f"{m['role']}: {m['content']}" for m in messages[:-1] if m["role"] != "system"]
    return {"user": messages[-1]["content"], "system": "\n\n".join(system) or None,
            "context": "\n".join(between) or None}


def settings(spec: JobSpec) -> JobSpecTrainingEvalGenerate:
    """`training.eval_generate`, of a job that has it: what every function here is given
    (EvalGenerator.for_job returns a NoGeneration without it)."""
    generate = spec["training"]["eval_generate"]
    if generate is None:
        raise ValueError("training.eval_generate is not set: the job generates nothing")
    return generate


def source_records(spec: JobSpec) -> list:
    """The records the prompts come from: the prompts file's, or the first N of `data.eval`."""
    data = spec["data"]
    source = settings(spec)["prompts"]
    if isinstance(source, str):
        return file_records(Path(source))
    # validation refuses a count of prompts without data.eval (eval-generate-no-eval)
    if data["eval"] is None:
        raise ValueError("training.eval_generate.prompts counts evaluation records, but data.eval "
                         "is not set")
    if not split_format(data, "eval").holds_records:
        raise spec_error("text records have no prompt and answer to generate from",
                         path=(*FIELD, "prompts"),
                         hint="give a prompts file, or evaluate on chat or prompt/completion "
                              "records")
    table = load_dataset(spec, "eval")
    if not record_kind(spec, table.column_names).rendered:
        raise spec_error(f"the evaluation records of {data['eval']} are text, with no prompt to "
                         "generate from",
                         path=(*FIELD, "prompts"),
                         hint="give a prompts file, or evaluate on chat or prompt/completion "
                              "records")
    return [dict(row) for row in table.select(range(min(int(source), len(table))))]


def file_records(path: Path) -> list:
    """A prompts file: JSON lines (chat records, prompt records, strings), or text with one prompt a
    line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise spec_error(f"cannot read the prompts file {path}: {first_line(err)}",
                         path=(*FIELD, "prompts"),
                         hint="give a UTF-8 .jsonl or .txt file") from None
    if path.suffix.lower() == ".txt":
        return [line for line in lines if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as err:
            raise spec_error(f"{path}:{number}: not JSON: {first_line(err)}",
                             path=(*FIELD, "prompts"),
                             hint="one JSON record (or string) per line") from None
    return records


def build_prompts(spec: JobSpec, tokenizer, template: str | None, records: list) -> list[Prompt]:
    """The records rendered as the model is prompted (module docstring). SpecError names a bad
    record."""
    data, generate = spec["data"], settings(spec)
    keep = max(1, data["max_length"] - generate["max_new_tokens"])
    prompts = []
    for index, record in enumerate(records):
        try:
            messages, reference = conversation(record, data)
            if template is not None:   # what training puts before an answer (data/chat_render)
                ids = generation_prompt_ids(tokenizer, template, messages)
            # prompt records of a tokenizer without a template: as training renders them
            elif len(messages) == 1:
                ids = tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
            else:
                raise ValueError("a conversation needs a chat template, and the job has none")
        except (ValueError, KeyError, TypeError) as err:
            raise spec_error(f"prompt {index + 1} cannot be rendered: {first_line(err)}",
                             path=(*FIELD, "prompts"),
                             hint="give chat records ({role, content} messages ending with a user "
                                  "turn), prompt records or strings") from None
        # the template failing on this record (raise_exception, an undefined name)
        except Exception as err:
            raise spec_error(f"the chat template failed on prompt {index + 1}: {first_line(err)}",
                             path=(*FIELD, "prompts"),
                             hint="fix the record, or the template") from None
        prompts.append(Prompt(shown_text(messages), list(ids)[-keep:], reference,
                              **prompt_parts(messages)))
    if not prompts:
        raise spec_error("there are no prompts to generate from", path=(*FIELD, "prompts"),
                         hint="give a file with at least one prompt, or evaluation records")
    return prompts


# --- the answers ---------------------------------------------------------------------------------

def exact_match(answer: str, reference: str) -> bool:
    return " ".join(answer.split()) == " ".join(reference.split())


def decode_answer(tokenizer, new_ids: list[int], end_ids: list[int], pad_id: int | None) -> Answer:
    """The generated ids after the prompt, up to the first end token (counted, not shown)."""
    ends = set(end_ids)
    for n, token in enumerate(new_ids):
        if token in ends:
            return Answer(tokenizer.decode(new_ids[:n], skip_special_tokens=True).strip(), n + 1,
                          STOP)
    # generate pads a finished row of a batch; an unfinished one ran to max_new_tokens
    return Answer(tokenizer.decode(new_ids, skip_special_tokens=True).strip(), len(new_ids), LENGTH)


@contextlib.contextmanager
def training_rng_kept(device):
    """Run the block with its own random state: torch's (CPU and this rank's GPU), Python's and
    NumPy's are as they were afterwards, whatever the block drew."""
    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device] if getattr(device, "type", "cpu") == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def left_padded(rows: list[list[int]], pad_id: int):
    import torch
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


class AllRanksEnded:
    """A `generate` stopping criterion for ZeRO-3's lockstep: every row of every rank stops
    together, once each has written an end token (the answers are cut there: `decode_answer`). With
    per-row EOS stopping a rank whose rows ended first runs the remaining steps as `synced_gpus`'
    idle peer; one small all-reduce per token (over the worker's gloo group) keeps every rank
    generating instead."""

    def __init__(self, end_ids: list[int], prompt_length: int, group=None):
        self.end_ids, self.prompt_length, self.group = list(end_ids), prompt_length, group

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        new = input_ids[:, self.prompt_length:].cpu()
        ended = False
        if self.end_ids and new.shape[1]:
            ends = torch.tensor(self.end_ids, dtype=new.dtype)
            ended = bool(torch.isin(new, ends).any(dim=1).all())
        running = any_rank(not ended, self.group)
        return torch.full((input_ids.shape[0],), not running, dtype=torch.bool,
                          device=input_ids.device)


def generating_module(engine):
    """The model `generate` belongs to: the engine's module, without torch.compile's wrapper."""
    module = engine.module
    return getattr(module, "_orig_mod", module)


class EvalGenerator:
    """One rank's part of `training.eval_generate` (module docstring). `run` is collective."""

    def __init__(self, generate: JobSpecTrainingEvalGenerate, training_seed: int, tokenizer,
                 prompts: list[Prompt], end_ids: list[int], *, rank: int, world_size: int,
                 batch_size: int, zero3: bool, group=None, run_dir: Path | None = None, sink=None,
                 progress=None):
        self.tokenizer, self.prompts, self.end_ids = tokenizer, prompts, end_ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else (end_ids or [0])[0]
        self.max_new_tokens = generate["max_new_tokens"]
        self.temperature = float(generate["temperature"])
        seed = generate["seed"] if generate["seed"] is not None else training_seed
        self.seed = seed + rank   # each rank samples its own prompts from its own stream
        self.rank, self.world, self.zero3 = rank, world_size, zero3
        self.batch_size = max(1, batch_size)
        self.group, self.run_dir, self.sink, self.progress = group, run_dir, sink, progress
        self.recorded_steps = ({int(r["step"]) for r in rundir.read_generations(run_dir)}
                               if run_dir is not None and rank == 0 else set())

    @classmethod
    def for_job(cls, spec: JobSpec, *, batch_size: int, zero3: bool, run_dir: Path, rank: int,
                world_size: int, group, sink, progress) -> "EvalGenerator | NoGeneration":
        """The generator of the job, a NoGeneration without `training.eval_generate`. `batch_size`:
        the prompts per `generate` call (the derived micro-batch); `zero3`: the engine partitions
        its weights."""
        if not spec["training"]["eval_generate"]:
            return NoGeneration()
        from jobspec.data.chat_render import chat_template
        from jobspec.model.build import build_tokenizer
        from jobspec.model.chat_turns import end_of_turn_ids

        tokenizer = build_tokenizer(spec)
        template = chat_template(spec, tokenizer)
        prompts = build_prompts(spec, tokenizer, template, source_records(spec))
        return cls(settings(spec), spec["training"]["seed"], tokenizer, prompts,
                   end_of_turn_ids(tokenizer, template), rank=rank,
                   world_size=world_size, batch_size=batch_size, zero3=zero3, group=group,
                   run_dir=run_dir, sink=sink, progress=progress)

    # --- generating -------------------------------------------------------------------------------

    def shares(self) -> list[list[int]]:
        """This rank's prompt indices per `generate` call. Under ZeRO-3 every rank makes the same
        number of calls (the collective forwards must pair up): a short rank repeats its last prompt
        (or the first one), marked by a negative index whose answer is dropped."""
        mine = list(range(self.rank, len(self.prompts), self.world))
        calls = math.ceil(math.ceil(len(self.prompts) / self.world) / self.batch_size)
        batches = [mine[i * self.batch_size:(i + 1) * self.batch_size] for i in range(calls)]
        if not self.zero3 or self.world == 1:
            return [b for b in batches if b]
        filler = -(mine[-1] if mine else 0) - 1
        return [b or [filler] for b in batches]

    def generate(self, engine) -> dict[int, Answer]:
        """This rank's answers by prompt index. Collective under ZeRO-3."""
        import torch
        from transformers import StoppingCriteriaList

        module = generating_module(engine)
        was_training = module.training
        answers: dict[int, Answer] = {}
        sampling = self.temperature > 0
        lockstep = self.zero3 and self.world > 1
        options = dict(max_new_tokens=self.max_new_tokens, do_sample=sampling,
                       eos_token_id=self.end_ids or None,
                       pad_token_id=self.pad_id, use_cache=True, synced_gpus=lockstep)
        if sampling:
            options.update(temperature=self.temperature, top_k=0, top_p=1.0)
        engine.eval()
        try:
            # eager under model.compile: the KV cache's state would recompile each compiled layer
            with (training_rng_kept(engine.device), torch.no_grad(),
                  torch.compiler.set_stance("force_eager")):
                torch.manual_seed(self.seed)
                for batch in self.shares():
                    rows = [self.prompts[i if i >= 0 else -i - 1].ids for i in batch]
                    ids, mask = left_padded(rows, self.pad_id)
                    if lockstep:   # every rank stops at the same token (AllRanksEnded), none idles
                        options.update(eos_token_id=None, stopping_criteria=StoppingCriteriaList(
                            [AllRanksEnded(self.end_ids, ids.shape[1], self.group)]))
                    out = module.generate(input_ids=ids.to(engine.device),
                                          attention_mask=mask.to(engine.device), **options)
                    new = out[:, ids.shape[1]:].tolist()
                    for index, row in zip(batch, new):
                        if index >= 0:
                            answers[index] = decode_answer(self.tokenizer, row, self.end_ids,
                                                           self.pad_id)
        finally:
            if was_training:
                engine.train()
        return answers

    def gather(self, answers: dict[int, Answer]) -> dict[int, Answer] | None:
        """Every rank's answers on rank 0 (None elsewhere)."""
        if self.world == 1:
            return answers
        import torch.distributed as dist
        box = [None] * self.world if self.rank == 0 else None
        dist.gather_object(answers, box, dst=0, group=self.group)
        if self.rank != 0:
            return None
        merged: dict[int, Answer] = {}
        for part in box or []:
            merged.update(part or {})
        return merged

    # --- one evaluation ---------------------------------------------------------------------------

    def run(self, engine, state) -> list[dict] | None:
        """Generate for every prompt and record the answers (rank 0); the rows on rank 0, None
        elsewhere."""
        started = time.perf_counter()
        answers = self.gather(self.generate(engine))
        seconds = time.perf_counter() - started
        if answers is None:
            return None
        rows = self.rows(state.step, answers)
        self.record(state, rows, seconds)
        return rows

    def rows(self, step: int, answers: dict[int, Answer]) -> list[dict]:
        rows = []
        for index, prompt in enumerate(self.prompts):
            answer = answers[index]
            match = exact_match(answer.text, prompt.reference) if prompt.reference is not None \
                else None
            rows.append({"step": int(step), "index": index, "prompt": prompt.text,
                         "user": prompt.user, "system": prompt.system, "context": prompt.context,
                         "reference": prompt.reference, "generation": answer.text,
                         "tokens": answer.tokens, "stop_reason": answer.stop_reason,
                         "exact_match": match})
        return rows

    def record(self, state, rows: list[dict], seconds: float) -> None:
        step = rows[0]["step"]
        matches = [row["exact_match"] for row in rows if row["exact_match"] is not None]
        metrics = {"time/eval_generate_s": seconds}
        if matches:
            metrics["eval/exact_match"] = sum(matches) / len(matches)
        if self.run_dir is not None and step not in self.recorded_steps:
            rundir.append_generations(self.run_dir, rows)
            self.recorded_steps.add(step)
        if self.sink is not None:
            self.sink.log(metrics, step=step)
            self.sink.log_table(step, rows)
        first = rows[0]
        state.generation = {k: first[k]
                            for k in ("step", "prompt", "reference", "generation", "stop_reason")}
        if self.progress is not None:
            stops = sum(row["stop_reason"] == STOP for row in rows)
            said = f", exact match {sum(matches)}/{len(matches)}" if matches else ""
            self.progress.message(f"step {step}: {len(rows)} answers generated in {seconds:.1f} s "
                                  f"({stops} ended their turn{said}); first: "
                                  f"{excerpt(first['generation'])}")


class NoGeneration:
    """The generation policy without `training.eval_generate`: an evaluation generates nothing."""

    def run(self, engine, state) -> None:
        return None


def excerpt(text: str | None, limit: int = SHOWN_CHARS) -> str:
    """One line of at most `limit` characters, quoted."""
    flat = " ".join((text or "").split())
    return json.dumps(flat if len(flat) <= limit else flat[:limit - 1] + "…", ensure_ascii=False)
