"""`model.kernels: liger`: Liger's fused RMSNorm, gated MLP, rotary and linear cross-entropy
(model/fused_kernels.py on the ranks and, stood in, in the planner's trace; the rules:
spec/rules/kernels.py). It comes before the patches that wrap the layers' modules (the tiled
MLP)."""
from __future__ import annotations

from jobspec.spec.rules import kernels as kernel_rules
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique


def _args(spec: JobSpec) -> dict | None:
    if spec["model"]["kernels"] == "none":
        return None
    return {"kernels": spec["model"]["kernels"], "fused_loss": kernel_rules.fused_loss(spec)}


def _text(args: dict) -> str:
    return (f"{args.get('kernels')} kernels (RMSNorm, gated MLP, rotary"
            + (", fused linear cross-entropy)" if args.get("fused_loss") else ")"))


TECHNIQUE = Technique(
    name="fused_kernels", summary="Liger's fused kernels (`model.kernels: liger`)",
    args=_args, text=_text, apply="jobspec.model.fused_kernels:fused_kernels",
    rules=(kernel_rules.kernels_issues,))
