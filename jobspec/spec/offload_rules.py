"""The offload rules of `memory` (which ZeRO stage each offload needs, and the NVMe path): one
definition for validation, which reports them positioned, and the compiler, which refuses a spec
built without validation (a fit candidate, a test's) with the same words. Pure."""
from __future__ import annotations


def offload_problems(memory: dict) -> list[tuple[tuple, str, str]]:
    """(path, message, hint) of each offload rule `memory` (defaults filled) breaks: validation
    reports them positioned, and the compiler refuses a spec built without validation (a fit
    candidate, a test's) with the same words."""
    offload, stage = memory["offload"], memory["zero_stage"]
    problems = []
    if offload["params"] != "none" and stage != 3:
        problems.append((("memory", "offload", "params"),
                         f"parameter offload needs ZeRO stage 3 (zero_stage is {stage})", "set `memory.zero_stage: 3`"))
    if offload["optimizer"] != "none" and stage < 1:
        problems.append((("memory", "offload", "optimizer"),
                         "optimizer offload needs ZeRO stage >= 1 (zero_stage is 0)",
                         "set `memory.zero_stage` to 1, 2 or 3"))
    if "nvme" in (offload["params"], offload["optimizer"]) and not offload["nvme_path"]:
        which = "params" if offload["params"] == "nvme" else "optimizer"
        problems.append((("memory", "offload", which), "nvme offload needs `memory.offload.nvme_path`",
                         "set it to a directory on a local NVMe drive"))
    return problems
