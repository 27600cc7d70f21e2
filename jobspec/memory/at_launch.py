"""Memory decisions `jobspec launch` makes before starting anything: `memory.fit: auto`, the GPU
free-memory pre-flight, and the plan recorded next to the measured memory.

- fit: the budget is `memory.gpu_memory`, else the free memory of this host's GPUs (NVML, read in
  this process); without either (a CPU-only host) fitting is skipped with a note. The chosen
  changes are applied to the resolved spec, so resolved.yaml and ds_config.json show what ran.
- pre-flight: on a GPU host, a plan whose per-rank NVML-style total exceeds the GPUs' free memory
  stops the launch (exit 2) unless `--ignore-preflight`.
- record: the plan (MiB per component) goes to launch.json (`plan`, and `fit` when fitting ran) and
  to the MLflow run as `plan.*` / `fit.*` params, logged by the launcher right after it creates the
  run, so they exist even when the ranks die at start-up (an OOM is when the prediction matters).

Test hook: JOBSPEC_FAKE_GPU_FREE_BYTES=N makes this host look like one whose GPUs each have N bytes
free (fit budget and pre-flight, on a CPU-only machine). Pure apart from NVML: no torch.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

from jobspec.errors import SpecError, spec_error

FAKE_FREE_ENV = "JOBSPEC_FAKE_GPU_FREE_BYTES"
MiB = 2**20
log = logging.getLogger("jobspec.launch")


@dataclass
class LaunchMemory:
    """What the launch decided about memory; `lines` are printed to the user."""

    plan: object | None = None          # planner.MemoryPlan of the spec that runs, None if not plannable
    fit: object | None = None           # fit.FitResult when `memory.fit: auto` ran
    budget: int | None = None
    budget_source: str | None = None    # "memory.gpu_memory" | "free GPU memory"
    lines: list = field(default_factory=list)


def gpu_free_bytes(num_devices: int, environ=os.environ) -> int | None:
    """The least free memory among the first `num_devices` GPUs this host's ranks use, or None
    without GPUs. NVML indices follow CUDA_VISIBLE_DEVICES when it lists integers."""
    fake = environ.get(FAKE_FREE_ENV)
    if fake:
        return int(fake)
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no library, no driver: a CPU-only host
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        indices = [int(v) for v in visible] if visible and all(v.isdigit() for v in visible) else range(count)
        indices = [i for i in indices if i < count][:max(1, num_devices)]
        free = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free for i in indices]
        return min(free) if free else None
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def bf16_supported(environ=os.environ) -> bool:
    """Compute capability >= 8.0 (Ampere) on GPU 0; True without an NVIDIA GPU (CPU ranks do bf16)."""
    if environ.get(FAKE_FREE_ENV):
        return True
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            major, _ = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(0))
            return major >= 8
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return True


def prepare(resolved, job, environ=os.environ):
    """(resolved spec to run, LaunchMemory): `memory.fit: auto` applied, the plan of the result.

    Nothing fits the budget -> SpecError (exit 2) with the smallest configuration's numbers.
    """
    from jobspec.memory.fit import apply_changes, fit
    from jobspec.memory.planner import fmt_bytes, parse_bytes, plan_memory

    spec = resolved.spec
    memory = LaunchMemory()
    if spec["memory"]["gpu_memory"]:
        memory.budget, memory.budget_source = parse_bytes(spec["memory"]["gpu_memory"]), "memory.gpu_memory"
    else:
        free = gpu_free_bytes(spec["resources"]["gpus_per_node"], environ)
        if free is not None:
            memory.budget, memory.budget_source = free, "free GPU memory"
    if spec["memory"]["fit"] == "auto":
        if memory.budget is None:
            memory.lines.append("fit: skipped (memory.fit is auto, but this host has no GPU and "
                                "memory.gpu_memory is not set): running the spec as written")
        else:
            result = fit(spec, job, memory.budget, bf16_supported=bf16_supported(environ))
            if not result.fits:
                raise spec_error(f"memory.fit is auto and {result.reason}", path=("memory", "fit"),
                                 hint=f"budget from {memory.budget_source}; see `jobspec plan JOB --fit` "
                                      "for the breakdown, or set memory.fit: off to run as written")
            memory.fit = result
            memory.lines.append(f"fit: {result.reason} (budget {fmt_bytes(memory.budget)} from "
                                f"{memory.budget_source}; {result.considered} configurations considered)")
            if result.changes:
                spec = apply_changes(spec, result.changes)
                resolved = dataclasses.replace(resolved, spec=spec)
                job = job.with_spec(spec)
                memory.lines.append("fit: applied " + " ".join(f"--set {o}" for o in result.overrides))
    try:
        memory.plan = plan_memory(spec, job, budget=memory.budget)
    except SpecError as err:  # an architecture the planner cannot count: launch anyway, unplanned
        memory.lines.append(f"memory plan unavailable ({err.issues[0].message}): no plan.* params, no "
                            "memory pre-flight")
    return resolved, job, memory


def preflight_problems(memory: LaunchMemory, spec: dict, environ=os.environ) -> list[str]:
    """The GPU memory check `--ignore-preflight` turns into a warning; none on a CPU-only host."""
    from jobspec.memory.planner import fmt_bytes
    free = gpu_free_bytes(spec["resources"]["gpus_per_node"], environ)
    plan = memory.plan
    if free is None or plan is None or plan.nvml_total <= free:
        return []
    return [(f"the plan predicts {fmt_bytes(plan.nvml_total)} per GPU (peak allocated "
             f"{fmt_bytes(plan.peak_allocated)}, reserved {fmt_bytes(plan.peak_reserved)}, plus the CUDA "
             f"context) but this host's GPU has {fmt_bytes(free)} free: "
             f"run `jobspec plan JOB --fit --gpu-mem {free // MiB}MiB` for settings that fit, "
             "or set memory.fit: auto")]


def plan_record(memory: LaunchMemory) -> dict:
    """launch.json's `plan` (MiB per component) and `fit` entries."""
    record = {}
    if memory.plan is not None:
        plan = memory.plan
        mib = {f"{k}_mib": _mib(v) for k, v in plan.breakdown.items()}
        mib.update(peak_allocated_mib=_mib(plan.peak_allocated), peak_reserved_mib=_mib(plan.peak_reserved),
                   nvml_total_mib=_mib(plan.nvml_total), host_total_mib=_mib(plan.host_total))
        if plan.nvme_total:
            mib["nvme_total_mib"] = _mib(plan.nvme_total)
        if memory.budget is not None:
            mib["budget_mib"] = _mib(memory.budget)
        record["plan"] = mib
    if memory.fit is not None:
        result = memory.fit
        record["fit"] = {"changes": result.changes, "overrides": result.overrides, "reason": result.reason,
                         "slowdown": round(result.slowdown, 3), "considered": result.considered,
                         "budget_mib": _mib(memory.budget), "budget_source": memory.budget_source}
    return record


def mlflow_params(memory: LaunchMemory, fit_setting: str) -> dict[str, str]:
    """`plan.<component>_mib` and, with `memory.fit: auto`, `fit.*`, as MLflow param strings."""
    record = plan_record(memory)
    params = {f"plan.{k}": f"{v:.1f}" for k, v in record.get("plan", {}).items()}
    if fit_setting == "auto":
        fit_record = record.get("fit")
        params["fit.applied"] = json.dumps(bool(fit_record and fit_record["changes"]))
        if fit_record is None:
            params["fit.reason"] = "skipped: no GPU and no memory.gpu_memory"
        else:
            params.update({"fit.changes": json.dumps(fit_record["changes"], sort_keys=True),
                           "fit.reason": fit_record["reason"], "fit.slowdown": str(fit_record["slowdown"]),
                           "fit.budget_mib": f"{fit_record['budget_mib']:.1f}",
                           "fit.budget_source": fit_record["budget_source"],
                           "fit.considered": str(fit_record["considered"])})
    return params


def log_params(tracked, params: dict[str, str]) -> None:
    """Add params to the launcher's MLflow run; a resumed run keeps its earlier values (immutable)."""
    from mlflow.entities import Param

    from jobspec.tracking.telemetry import param_batches
    try:
        existing = tracked.client.get_run(tracked.run_id).data.params
        for batch in param_batches({k: v for k, v in params.items() if k not in existing}):
            tracked.client.log_batch(tracked.run_id, params=[Param(k, v) for k, v in batch.items()],
                                     synchronous=True)
    except Exception as err:  # the run exists and training can go on: the params are a nicety
        log.warning("could not log plan/fit params to MLflow: %s", str(err).splitlines()[0][:300])


def _mib(n: float) -> float:
    return round(n / MiB, 1)
