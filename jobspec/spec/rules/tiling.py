"""`memory.tiled_loss` and `memory.tiled_mlp` (jobspec/model/tiling.py): what they tile must exist.

The tiled loss runs a causal LM's output projection and its next-token cross-entropy over sequence
tiles, summing each tile's per-token losses; a task whose loss is not a per-token cross-entropy over
that head's outputs (one label per sequence) has nothing to tile, and the masked-LM and
token-classification heads (a transform before the decoder, a classifier of a few classes) are not
tiled: their logits are small or their head is not one projection."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec import tasks
from jobspec.errors import SpecIssue
from jobspec.spec.types import JobSpecModel
from jobspec.tasks.base import CLASS

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
