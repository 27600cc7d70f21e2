"""Cross-field rules of the Adam fields (`training.optimizer.implementation`, `bias_correction`),
`memory.fp16.auto_cast` and the `export` section: values one field's schema cannot judge alone; and
the exported weights' dtype, which the rank side and the launch's disk pre-flight both need.

Pure, like the rest of jobspec.spec: called by `validation.cross_field_issues` on the defaults-filled spec.
"""
from __future__ import annotations


def resolve_dtype(spec: dict, requested: str | None = None) -> str:
    """fp32 | bf16 | fp16: `requested` (CLI), else `export.dtype`, whose `auto` follows `memory.precision`."""
    choice = requested or (spec.get("export") or {}).get("dtype", "auto")
    if choice == "auto":
        return spec["memory"]["precision"]
    return choice


def optimizer_issues(r) -> list:
    s = r.spec
    optimizer, memory = s["training"]["optimizer"], s["memory"]
    name, implementation = optimizer["name"], optimizer["implementation"]
    offload = memory["offload"]["optimizer"]
    where = ("training", "optimizer")
    issues = []
    if name != "adamw":
        if implementation != "auto":
            issues.append(r.issue(where + ("implementation",), f"`implementation` chooses the Adam of `adamw`, "
                                  f"not of `{name}`", "remove it, or set `name: adamw`"))
        if not optimizer["bias_correction"]:
            issues.append(r.issue(where + ("bias_correction",), f"`bias_correction` is an Adam setting of `adamw`, "
                                  f"not of `{name}`", "remove it, or set `name: adamw`"))
        return issues
    if implementation == "fused" and offload != "none":
        issues.append(r.issue(where + ("implementation",), f"`fused` Adam cannot run with optimizer offload "
                              f"(memory.offload.optimizer is {offload}): DeepSpeed runs its CPU Adam there",
                              "use `implementation: auto` (or `cpu`), or `memory.offload.optimizer: none`"))
    if implementation == "cpu" and offload == "none":
        issues.append(r.issue(where + ("implementation",), "`cpu` Adam needs optimizer offload: DeepSpeed builds "
                              "its CPU Adam only for offloaded optimizer states",
                              "set `memory.offload.optimizer: cpu` (with zero_stage >= 1), or use `auto`"))
    if implementation == "torch" and not optimizer["bias_correction"]:
        issues.append(r.issue(where + ("bias_correction",), "torch.optim.AdamW always corrects the bias: "
                              "`bias_correction: false` needs DeepSpeed's own Adam",
                              "use `implementation: auto`, `fused` or `cpu`, or remove `bias_correction`"))
    return issues


def precision_issues(r) -> list:
    memory = r.spec["memory"]
    if memory["fp16"]["auto_cast"] and memory["precision"] != "fp16":
        return [r.issue(("memory", "fp16", "auto_cast"), f"`auto_cast` casts inputs to fp16, but precision is "
                        f"{memory['precision']}", "set `memory.precision: fp16`, or remove `auto_cast`")]
    return []


def export_issues(r) -> list:
    s = r.spec
    data = s["data"]
    has_eval = data["eval"] is not None or bool((data["synthetic"] or {}).get("eval_samples"))
    if s["export"]["best_eval"] and not has_eval:
        return [r.issue(("export", "best_eval"), "`best_eval` exports at the lowest evaluation loss, but the job "
                        "has no evaluation data", "set `data.eval` (or `data.synthetic.eval_samples`), or remove "
                        "`export.best_eval`")]
    return []


def issues(r) -> list:
    return optimizer_issues(r) + precision_issues(r) + export_issues(r)
