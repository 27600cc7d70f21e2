"""`memory.tiled_loss`: a causal LM's output projection and next-token cross-entropy over sequence
tiles, each tile's per-token losses summed (DeepSpeed ALST's tiling: model/tiling.tiled_loss, on the
ranks and in the planner's trace); `tiles: null` as many as keep one tile's logits within 1 GiB.

What it tiles must exist: a task whose loss is not a per-token cross-entropy over that head's
outputs (one label per sequence) has nothing to tile, and the masked-LM and token-classification
heads (a transform before the decoder, a classifier of a few classes) are not tiled: their logits
are small or their head is not one projection. Liger's fused loss computes the loss itself: no tiled
loss beside it (techniques/fused_kernels.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec import tasks
from jobspec.errors import SpecIssue
from jobspec.spec.types import JobSpec, JobSpecMemory, JobSpecModel
from jobspec.tasks.base import CLASS
from jobspec.techniques.base import FitStep, Technique
from jobspec.techniques.fused_kernels import fused_loss

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

TILED_TASKS = ("causal-lm",)


def tiled_loss_issues(r: ResolvedSpec) -> list[SpecIssue]:
    if not r.spec["memory"]["tiled_loss"]:
        return []
    task = r.spec["model"]["task"]
    if task in TILED_TASKS:
        if r.spec["memory"]["zero_stage"] >= 1 and trains_tied_head(r.spec["model"]):
            # the tiles' backward stores the tied weight's gradient before the embeddings add
            # theirs: ZeRO 1-2 refuse a second reduction ("Gradient computed twice"), ZeRO-3 loses
            # one (2 CPU ranks)
            return [r.issue(("memory", "tiled_loss"),
                            "the tiled loss cannot train a head tied to the input "
                            "embeddings under ZeRO 1-3 (the tiles and the embeddings reduce the "
                            "tied weight's gradient separately, which DeepSpeed's ZeRO refuses or "
                            "gets wrong)",
                            "memory.zero_stage: 0, or model.config.tie_word_embeddings: false",
                            code="tiled-loss-tied-zero")]
        return []
    if tasks.get(task).labels == CLASS:
        why = (f"{task}'s loss is one cross-entropy per sequence (its pooled logits), not a "
               "per-token loss to tile")
    else:
        why = (f"{task}'s head is not tiled: the tiled loss runs a causal LM's output projection "
               "over its vocabulary (the logits that grow with the sequence)")
    return [r.issue(("memory", "tiled_loss"), why, "remove memory.tiled_loss (it is for causal-lm)",
                    code="tiled-loss-task")]


def trains_tied_head(model: JobSpecModel) -> bool:
    """Whether the tiled loss would train a head tied to the input embeddings (no LoRA): refused
    under ZeRO 1-3 (`tiled_loss_issues`), so `--fit` (memory/fit.py) does not try that
    combination."""
    return tied_embeddings(model) and model["lora"] is None


def tied_embeddings(model: JobSpecModel) -> bool:
    """Whether the spec's model ties its head to the input embeddings: `model.config`, else the
    architecture's default (spec/model_dims); a local checkpoint's config.json is checked by the
    ranks."""
    from jobspec.spec.model_dims import ARCHITECTURE_DEFAULTS

    value = model["config"].get("tie_word_embeddings")
    architecture = model["architecture"]
    if value is None and architecture:
        value = ARCHITECTURE_DEFAULTS.get(architecture, {}).get("tie_word_embeddings")
    return bool(value)


def _args(spec: JobSpec) -> dict | None:
    tiled = spec["memory"]["tiled_loss"]
    if not tiled:
        return None
    return {"tiles": tiled["tiles"] if isinstance(tiled, dict) else None}


def _text(args: dict) -> str:
    tiles = args.get("tiles")
    return "tiled loss " + (f"({tiles} tiles)" if tiles else "(tiles of at most 1 GiB of logits)")


def _trace_value(memory: JobSpecMemory) -> bool | int:
    """False, True (tiles by the bound) or a tile count."""
    loss = memory["tiled_loss"]
    return int(loss["tiles"]) if isinstance(loss, dict) else bool(loss)


def _trace_args(value, checkpointed: list[int]) -> dict | None:
    if value is False:
        return None
    return {"tiles": None if value is True else int(value)}


def plan_text(setting) -> str:
    """The plan's `tiled loss` setting (memory/planner: its settings line)."""
    if not setting:
        return "off"
    return f"{setting['tiles']} tiles" if isinstance(setting, dict) else "on"


def _offerable(spec: JobSpec, zero_stage: int) -> bool:
    return spec["model"]["task"] == "causal-lm" and not spec["memory"]["tiled_loss"] and not (
        zero_stage >= 1 and trains_tied_head(spec["model"])) and not (
        fused_loss(spec))   # Liger's fused loss computes it: no tiled loss beside it


def _fit_refused(spec: JobSpec, wanted: dict) -> bool:
    """Validation refuses a tied head's tiled loss under ZeRO 1-3."""
    return wanted["memory.zero_stage"] >= 1 and trains_tied_head(spec["model"])


TECHNIQUE = Technique(
    name="tiled_loss", summary="the head and the loss one tile of the sequence at a time (ALST)",
    args=_args, text=_text, apply="jobspec.model.tiling:tiled_loss",
    trace_args=_trace_args, trace_value=_trace_value,
    trace_imports=("deepspeed.runtime.sequence_parallel.ulysses_sp",),
    rules=(tiled_loss_issues,),
    fit=FitStep(key="memory.tiled_loss", changes={"memory.tiled_loss": True}, cost=1,
                words="tiled loss", is_on=lambda spec: bool(spec["memory"]["tiled_loss"]),
                available=lambda spec: not fused_loss(spec), refused=_fit_refused),
    remedy={"logits_and_loss": "--set memory.tiled_loss=true (the logits one tile at a time)"},
    offerable=_offerable)
