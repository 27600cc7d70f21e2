"""`model.kernels: liger`: Liger's fused RMSNorm, gated MLP, rotary and linear cross-entropy
(model/fused_kernels.py on the ranks and, stood in, in the planner's trace). It comes before the
patches that wrap the layers' modules (the tiled MLP).

Its rules refuse, at `model.kernels`, each with its fix:
  kernels-model      a model type jobspec does not map to Liger's kernels (the supported list); a
                     hub id whose type validation cannot read is checked again where its config is
                     built (the planner's trace, the ranks: `model_problem`)
  kernels-gpu        this host has no NVIDIA GPU: Liger's kernels are Triton programs for CUDA GPUs
  kernels-package    liger-kernel (or the Triton it needs) is not installed: the `gpu` extra
and at `memory.tiled_loss`:
  kernels-tiled-loss a causal LM's loss computed by the tiled loss and by Liger's fused linear
                     cross-entropy: exactly one of them computes it

Test hook: JOBSPEC_KERNELS_REFERENCE=1 runs the kernels' PyTorch references
(model/kernel_reference.py) where Liger's would run, so a CPU host accepts `liger` without the
package: the code path that applies the kernels and routes the loss runs on CPU ranks.

Pure: the spec, a local config.json, NVML's GPU count and whether the packages are installed
(found, not imported).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue
from jobspec.spec.freeform import local_checkpoint_config
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

REFERENCE_ENV = "JOBSPEC_KERNELS_REFERENCE"
# transformers model_type -> the MLP kernel model/fused_kernels.FAMILIES applies to it;
# tests/model/test_fused_kernels.py checks each family's fused loss against transformers' own
LIGER_FAMILIES = {"llama": "SwiGLU", "mistral": "SwiGLU", "qwen2": "SwiGLU", "qwen3": "SwiGLU",
                  "phi3": "SwiGLU (fused gate/up)", "gemma": "GeGLU", "gemma2": "GeGLU"}
GPU_EXTRA = "pip install 'jobspec[gpu]'"
FIELD = ("model", "kernels")


def reference_kernels(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the test hook swaps Liger's kernels for their PyTorch references."""
    return environ.get(REFERENCE_ENV, "") not in ("", "0")


def fused_loss(spec: JobSpec) -> bool:
    """Whether Liger's fused linear cross-entropy computes the job's loss (a causal LM's); a spec
    without the field (a test's partial one) has none."""
    model = spec.get("model") or {}
    return model.get("kernels") == "liger" and model.get("task") == "causal-lm"


def model_problem(model_type: str | None) -> tuple[str, str] | None:
    """(message, hint) when `model.kernels: liger` has no mapping for `model_type`; None when it
    has, or the type is unknown here (a hub id: asked again where its config is built)."""
    if model_type is None or model_type.replace("-", "_") in LIGER_FAMILIES:
        return None
    return (f"model.kernels: liger has no fused modules for model type {model_type!r} "
            f"(supported: {', '.join(sorted(LIGER_FAMILIES))})",
            "use a supported model type, or set `model.kernels: none`")


def kernels_problems(spec: JobSpec, config_json: dict | None = None,
                     environ: Mapping[str, str] = os.environ) -> list[tuple[tuple, str, str, str]]:
    """(path, message, hint, code) of each rule `spec` (defaults filled) breaks."""
    model = spec["model"]
    if model["kernels"] != "liger":
        return []
    problems: list[tuple[tuple, str, str, str]] = []
    model_type = model["architecture"] or (config_json or {}).get("model_type")
    problem = model_problem(model_type if isinstance(model_type, str) else None)
    if problem is not None:
        problems.append((FIELD, *problem, "kernels-model"))
    if not reference_kernels(environ):
        from jobspec import hardware

        if not hardware.job_host_has_gpu():
            where = "this host has" if hardware.checked_here() else "the job's nodes have"
            problems.append((FIELD, f"Liger's kernels are Triton programs for CUDA GPUs, and "
                             f"{where} none", "launch on a host with NVIDIA GPUs, or set "
                             "`model.kernels: none`", "kernels-gpu"))
        missing = [name for name in ("liger_kernel", "triton")
                   if importlib.util.find_spec(name) is None]
        if missing:
            problems.append((FIELD, f"Liger's kernels need {' and '.join(missing)}, not installed "
                             "here", f"`{GPU_EXTRA}` (liger-kernel and Triton), or set "
                             "`model.kernels: none`", "kernels-package"))
    if fused_loss(spec) and spec["memory"]["tiled_loss"]:
        problems.append((("memory", "tiled_loss"), "with model.kernels: liger, Liger's fused "
                         "linear cross-entropy computes the causal LM's loss without the logits; "
                         "the tiled loss would compute it too", "remove memory.tiled_loss (the "
                         "fused loss keeps one chunk of logits at a time), or set "
                         "`model.kernels: none`", "kernels-tiled-loss"))
    return problems


def kernels_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """`kernels_problems` of a ResolvedSpec, positioned and coded."""
    config_json = local_checkpoint_config(r) if r.spec["model"]["kernels"] == "liger" else None
    return [r.issue(path, message, hint, code=code)
            for path, message, hint, code in kernels_problems(r.spec, config_json)]


def _args(spec: JobSpec) -> dict | None:
    if spec["model"]["kernels"] == "none":
        return None
    return {"kernels": spec["model"]["kernels"], "fused_loss": fused_loss(spec)}


def _text(args: dict) -> str:
    return (f"{args.get('kernels')} kernels (RMSNorm, gated MLP, rotary"
            + (", fused linear cross-entropy)" if args.get("fused_loss") else ")"))


TECHNIQUE = Technique(
    name="fused_kernels", summary="Liger's fused kernels (`model.kernels: liger`)",
    args=_args, text=_text, apply="jobspec.model.fused_kernels:fused_kernels",
    trace="jobspec.model.fused_kernels:trace_kernels",
    rules=(kernels_issues,))
