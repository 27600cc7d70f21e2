"""`data.packing`: short samples packed into full-length rows, position ids restarting per sample
(data/sample_packing.py on the ranks). Its rules: where packed samples can be kept apart, and what
packing needs.

Packed samples share one row; only the model keeps them from attending to each other. In
transformers 5.x the decoder families below do so when the forward gets `position_ids` that restart
per sample, no 2-D attention mask and no KV cache (masking_utils.find_packed_sequence_indices: sdpa
and eager get a causal mask cut at the samples' boundaries; modeling_flash_attention_utils:
flash_attention_2 takes its varlen kernel from the position ids of a one-row batch, which
jobspec.data.sample_packing makes by flattening the micro-batch). Each family here was checked on
the installed transformers: a sample's logits packed between others equal its logits alone, sdpa and
eager, and the position ids reach the attention function, as flash attention needs
(tests/train/test_packing.py runs those checks on every entry). Families that build their own masks
or positions from the attention mask (OPT, Bloom's ALiBi, MPT, XGLM) or are not attention models are
not listed, and packing is refused for them.

Pure: `packing_issues` is its cross-field rule; the ranks ask `model_problem` again with the built
model's type, for a hub id whose type validation could not read.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.freeform import local_checkpoint_config
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

ATTENTIONS = frozenset({"sdpa", "eager", "flash_attention_2"})
# transformers model_type -> the `model.attention` values whose forward keeps packed samples apart
PACKED_FAMILIES: dict[str, frozenset[str]] = {name: ATTENTIONS for name in (
    "llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
    "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "olmo", "olmo2", "olmo3", "granite",
    "stablelm", "starcoder2", "cohere", "helium", "smollm3", "glm4")}


def model_problem(model_type: str | None, attention: str) -> tuple[str, str] | None:
    """(message, hint) when a `model_type` model with `attention` cannot keep packed samples apart;
    None when it can, or when the type is unknown (None)."""
    if model_type is None:
        return None
    family = model_type.replace("-", "_")
    honoured = PACKED_FAMILIES.get(family)
    if honoured is None:
        return ("packing needs a model that keeps packed samples apart by their position ids, and "
                f"{model_type} does not (its attention would cross the samples' boundaries)",
                "set `data.packing: false` (with `data.padding: longest` to skip most padding), or "
                f"use a decoder family that does: {', '.join(sorted(PACKED_FAMILIES))}")
    if attention not in honoured:
        return (f"{model_type} with attention {attention} does not keep packed samples apart",
                f"use `model.attention`: {' or '.join(sorted(honoured))}, or set `data.packing: "
                "false`")
    return None


def packing_problems(spec: JobSpec,
                     config_json: dict | None = None) -> list[tuple[tuple, str, str, str]]:
    """(path, message, hint, code) of each packing rule `spec` (defaults filled) breaks.
    `config_json`: the parsed config.json of a local `model.name_or_path`, where the model type is
    read otherwise."""
    data, model = spec["data"], spec["model"]
    if not data["packing"]:
        return []
    path = ("data", "packing")
    if model["task"] != "causal-lm":
        return [(path, f"packing is for causal-lm; the task is {model['task']}",
                 "set `data.packing: false`: an encoder's samples would attend to each other in a "
                 "packed row",
                 "packing-task")]
    problems = []
    if data["synthetic"] is not None:
        problems.append((path,
                         "packing packs file data; synthetic samples are all `seq_len` tokens long",
                         "set `data.packing: false`, or train on a file", "packing-synthetic"))
    if spec["training"]["epochs"] is not None:
        problems.append((path,
                         "with packing the number of training rows is known only after tokenizing, "
                         "so `training.epochs` cannot be turned into a step count",
                         "set `training.max_steps` instead of `training.epochs`", "packing-epochs"))
    model_type = model["architecture"] or (config_json or {}).get("model_type")
    problem = model_problem(model_type if isinstance(model_type, str) else None, model["attention"])
    if problem is not None:
        problems.append((path, *problem, "packing-model"))
    return problems


def packing_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """`packing_problems` of a ResolvedSpec, positioned and coded."""
    return [r.issue(path, message, hint, code=code)
            for path, message, hint, code in packing_problems(r.spec, local_checkpoint_config(r))]


TECHNIQUE = Technique(
    name="packing", summary="short samples packed into full rows, kept apart by their position ids",
    rules=(packing_issues,))
