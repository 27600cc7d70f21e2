"""`memory.sequence_parallel`: DeepSpeed Ulysses for Hugging Face models (ALST), N ranks sharing
each sequence (the ranks' groups: train/sequence_parallel.py; ds_config's `sequence_parallel_size`:
`ds_config`; the exchange buffers the plan adds: memory/ulysses_buffers). Its rules below.

Ulysses splits each sequence across N ranks and, around attention, swaps the split from the sequence
to the attention heads with an all-to-all (deepspeed.runtime.sequence_parallel.ulysses_sp
.UlyssesSPAttentionHF), so what it can wrap is narrow:

- N divides the world size (spec/derived refuses that one: the batch split needs world / N), the
  attention heads, and the key/value heads or is divided by them (DeepSpeed replicates a key/value
  head over N / kv ranks when there are fewer of them);
- the sequence: every rank gets `seq_len / N` tokens (`padding: longest` batches are padded to a
  multiple of N on the ranks, so there the bound is `max_length`);
- causal-lm on a decoder family whose attention goes through transformers' ALL_ATTENTION_FUNCTIONS
  with rotary positions taken from `position_ids` (ULYSSES_FAMILIES; the ranks ask `model_problem`
  again for a hub id whose type validation could not read);
- attention sdpa or flash_attention_2: the wrapper drops the model's 4-D mask and attends causally
  over the gathered sequence, which eager cannot do (DeepSpeed refuses it);
- no `data.packing`: sdpa would attend across the packed samples once their mask is dropped, and the
  flash-attention packing path flattens a micro-batch into one row before the sequence is gathered;
- no `model.compile` (the all-to-all inside a compiled attention is untested here).

Pure: `sequence_parallel_issues` is its cross-field rule.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.freeform import local_checkpoint_config
from jobspec.spec.model_dims import model_dims
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique

if TYPE_CHECKING:
    from jobspec.spec.derived import DerivedJob
    from jobspec.spec.validation import ResolvedSpec

# transformers model_type -> decoder families whose attention Ulysses wraps: attention through
# ALL_ATTENTION_FUNCTIONS with (batch, heads, seq, head_dim) tensors, `num_key_value_heads` in the
# config, rotary positions from `position_ids`, and no sliding window by default (the wrapper's
# causal attention over the whole sequence would ignore one). tests/train/test_sequence_parallel.py
# checks each listed family's logits with N = 2 against N = 1 on the installed transformers.
ULYSSES_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "olmo2"})
ULYSSES_ATTENTIONS = ("sdpa", "flash_attention_2")


def model_problem(model_type: str | None) -> tuple[str, str] | None:
    """(message, hint) when Ulysses cannot wrap a `model_type` model; None when it can or the type
    is unknown."""
    if model_type is None or model_type.replace("-", "_") in ULYSSES_FAMILIES:
        return None
    return ("sequence parallelism wraps the attention of decoder families it was checked on, and "
            f"{model_type} is not one of them",
            f"use a model of family {', '.join(sorted(ULYSSES_FAMILIES))}, or set "
            "`memory.sequence_parallel: 1`")


def sequence_parallel_problems(spec: JobSpec,
                               config_json: dict | None = None) -> list[tuple[tuple, str, str,
                                                                              str]]:
    """(path, message, hint, code) of each rule `spec` (defaults filled) breaks; none when N is 1.
    N against the world size is the derived job's refusal (spec/derived), reported by the batch
    rule."""
    n = spec["memory"]["sequence_parallel"]
    if n == 1:
        return []
    field = ("memory", "sequence_parallel")
    model, data = spec["model"], spec["data"]
    off = "or set `memory.sequence_parallel: 1`"
    problems: list[tuple[tuple, str, str, str]] = []
    if model["task"] != "causal-lm":
        problems.append((field,
                         "sequence parallelism is for causal-lm (the loss is summed over the "
                         f"shards' next tokens); the task is {model['task']}",
                         "set `memory.sequence_parallel: 1`", "sequence-parallel-task"))
    if model["attention"] not in ULYSSES_ATTENTIONS:
        problems.append((("model", "attention"),
                         f"sequence parallelism cannot wrap {model['attention']} attention: "
                         "Ulysses drops the model's 4-D mask and attends causally over the "
                         f"gathered sequence, which {model['attention']} cannot",
                         f"use `model.attention: sdpa` (or flash_attention_2), {off}",
                         "sequence-parallel-attention"))
    model_type = model["architecture"] or (config_json or {}).get("model_type")
    problem = model_problem(model_type if isinstance(model_type, str) else None)
    if problem is not None:
        problems.append((field, *problem, "sequence-parallel-model"))
    problems += _head_problems(spec, config_json, n, field)
    synthetic = data["synthetic"]
    seq_path, seq_len = (("data", "synthetic", "seq_len"), synthetic["seq_len"]) if synthetic \
        else (("data", "max_length"), data["max_length"])
    if isinstance(seq_len, int) and seq_len % n:
        lower, upper = seq_len // n * n, (seq_len // n + 1) * n
        problems.append((seq_path,
                         f"sequence length {seq_len} does not split into sequence_parallel {n} "
                         "equal shards",
                         f"use {f'{lower} or {upper}' if lower else upper}",
                         "sequence-parallel-seq-len"))
    if data.get("packing"):
        problems.append((("data", "packing"),
                         "packing with sequence parallelism would let packed samples attend to "
                         "each other: Ulysses drops the mask that keeps them apart under sdpa, and "
                         "flash attention's packed rows are flattened before the sequence is "
                         "gathered",
                         "set `data.packing: false` (`data.padding: longest` skips most padding), "
                         f"{off}",
                         "sequence-parallel-packing"))
    if model.get("compile"):
        problems.append((("model", "compile"),
                         "torch.compile with sequence parallelism is not supported "
                         "here (the all-to-all inside compiled attention is untested)",
                         f"set `model.compile: false`, {off}", "sequence-parallel-compile"))
    return problems


def _head_problems(spec: JobSpec, config_json: dict | None, n: int, field: tuple) -> list:
    dims = model_dims(spec, config_json)
    if dims is None or dims.num_heads is None:
        return []   # a hub id: the ranks' UlyssesSPAttentionHF refuses it with DeepSpeed's message
    problems = []
    if dims.num_heads % n:
        problems.append((field,
                         f"sequence_parallel {n} does not divide the model's {dims.num_heads} "
                         "attention heads (each rank attends over heads / N of them)",
                         f"use a divisor of {dims.num_heads}: {_divisors(dims.num_heads)}",
                         "sequence-parallel-heads"))
    kv = dims.num_key_value_heads or dims.num_heads
    if kv % n and n % kv:
        problems.append((field,
                         f"sequence_parallel {n} and the model's {kv} key/value heads do not "
                         "divide one another (DeepSpeed splits the key/value heads over the ranks, "
                         "or replicates each over N / kv ranks)",
                         f"use a divisor or multiple of {kv}", "sequence-parallel-kv-heads"))
    return problems


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def sequence_parallel_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """`sequence_parallel_problems` of a ResolvedSpec, positioned and coded."""
    return [r.issue(path, message, hint, code=code)
            for path, message, hint, code in sequence_parallel_problems(r.spec,
                                                                        local_checkpoint_config(r))]


def ds_config(spec: JobSpec, job: DerivedJob) -> dict:
    """`sequence_parallel_size` where N > 1: DeepSpeed's batch arithmetic counts world / N
    data-parallel ranks; the engine learns N from the Ulysses groups (train/sequence_parallel),
    ZeRO-3's zero.Init, which runs before them, from here."""
    return {"sequence_parallel_size": job.sequence_parallel} if job.sequence_parallel > 1 else {}


TECHNIQUE = Technique(
    name="sequence_parallel", summary="Ulysses: N ranks share each sequence, attention by heads",
    rules=(sequence_parallel_issues,), ds_config=ds_config)
