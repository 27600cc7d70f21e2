"""A rank's planned memory figures, each named once and paired with the reading that measures it.

The launch header, the closing block, summary.json (`planned_memory`), MLflow's `plan.*` params and
`jobspec report` all show a plan through `FIGURES`, so each says the same figure with the same name:

- on GPU ranks: `peak allocated` (torch's allocator), `reserved` (its segments) and `GPU total`
  (NVML: reserved and the CUDA context), per GPU; and `host RAM` (the rank's process, construction,
  offload buffers) against its RSS;
- on CPU ranks there is no GPU: the model's tensors live in the rank's own memory, so the plan's
  host RAM holds them (memory/planner.plan_memory with `cpu_ranks`) and `host RAM` is the one
  figure, set against the RSS. A CPU rank's plan records no GPU figure, so none is shown or logged.

A figure's plan is launch.json `plan[<plan_key>]` (MiB), MLflow's `plan.<plan_key>`; its reading is
the rank metric `metric` (max over ranks and windows, MiB), summary.json `peak_memory[metric]`.
Pure: names and MiB in, MiB out.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    label: str      # what the header, the closing block and the report call it
    plan_key: str   # launch.json plan key; MLflow param plan.<plan_key>
    metric: str     # the measured reading (summary.json peak_memory, MLflow metric)
    per: str        # "GPU" or "rank"


PEAK_ALLOCATED = Figure("peak allocated", "peak_allocated_mib", "mem/peak_allocated_mib_max", "GPU")
RESERVED = Figure("reserved", "peak_reserved_mib", "mem/peak_reserved_mib_max", "GPU")
GPU_TOTAL = Figure("GPU total", "nvml_total_mib", "mem/nvml_used_mib_max", "GPU")
HOST_RAM = Figure("host RAM", "host_total_mib", "mem/host_rss_mib_max", "rank")
FIGURES = (PEAK_ALLOCATED, RESERVED, GPU_TOTAL, HOST_RAM)
GPU_FIGURES = (PEAK_ALLOCATED, RESERVED, GPU_TOTAL)
# the plan keys only a GPU rank has (a CPU rank's plan record leaves them out)
GPU_PLAN_KEYS = ("peak_allocated_mib", "peak_reserved_mib", "nvml_total_mib")


def planned(plan_mib: Mapping[str, float]) -> dict[str, float]:
    """Each figure the plan holds, by the metric that measures it: {metric: planned MiB}
    (summary.json `planned_memory`)."""
    return {f.metric: float(plan_mib[f.plan_key]) for f in FIGURES
            if plan_mib.get(f.plan_key) is not None}


def from_params(params: Mapping[str, str]) -> dict[str, float]:
    """`planned` of a run's MLflow params (`plan.<key>` strings), leaving out a non-number."""
    plan: dict[str, float] = {}
    for f in FIGURES:
        try:
            plan[f.plan_key] = float(params[f"plan.{f.plan_key}"])
        except (KeyError, ValueError):
            continue
    return planned(plan)
