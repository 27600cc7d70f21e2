"""`model.compile`: torch.compile of each layer of the layer stack (regional compilation,
train/regional_compile.py), the last patch: it must see the final modules, adapters included. Its
rules (ZeRO 0-2; no quantised base, tiled MLP or offloaded checkpoint inputs):
spec/rules/model_compile.py; when it pays: memory/fit.compile_note."""
from __future__ import annotations

from jobspec.spec.rules import model_compile as compile_rules
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique


def _args(spec: JobSpec) -> dict | None:
    return {} if spec["model"]["compile"] else None


TECHNIQUE = Technique(
    name="torch_compile", summary="torch.compile of each layer (`model.compile`, regional)",
    args=_args, text=lambda args: "torch.compile of each layer (regional)",
    apply="jobspec.train.regional_compile:regional_compile", after_base=True,
    rules=(compile_rules.compile_issues,))
