"""Settings that need a training precision: flash attention runs in fp16 or bf16 only, and
`memory.fp16.auto_cast` casts inputs to fp16, so it needs `precision: fp16`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def flash_attention_issues(r: ResolvedSpec) -> list[SpecIssue]:
    if r.spec["model"]["attention"] == "flash_attention_2" \
            and r.spec["memory"]["precision"] == "fp32":
        return [r.issue(("model", "attention"), "flash_attention_2 needs fp16 or bf16",
                        "set `memory.precision: bf16` (or fp16), or use `attention: sdpa`",
                        code="flash-attention-fp32")]
    return []


def auto_cast_issues(r: ResolvedSpec) -> list[SpecIssue]:
    memory = r.spec["memory"]
    if memory["fp16"]["auto_cast"] and memory["precision"] != "fp16":
        return [r.issue(("memory", "fp16", "auto_cast"),
                        f"`auto_cast` casts inputs to fp16, but precision is "
                        f"{memory['precision']}",
                        "set `memory.precision: fp16`, or remove `auto_cast`",
                        code="fp16-auto-cast")]
    return []
