"""Memory decisions `jobspec launch` makes before starting anything: `memory.fit: auto`, the GPU
free-memory pre-flight, and the plan recorded next to the measured memory.

- fit: the budget is `memory.gpu_memory`, else the free memory of this host's GPUs (probed by the
  caller through jobspec.hardware); without either (a CPU-only host) fitting is skipped with a note. The chosen
  changes are applied to the resolved spec, so resolved.yaml and ds_config.json show what ran.
- pre-flight: on a GPU host, a plan whose per-rank NVML-style total exceeds the GPUs' free memory
  stops the launch (exit 2) unless `--ignore-preflight`.
- record: the plan (MiB per component) goes to launch.json (`plan`, and `fit` when fitting ran) and
  to the MLflow run as `plan.*` / `fit.*` params, logged by the launcher right after it creates the
  run, so they exist even when the ranks die at start-up (an OOM is when the prediction matters).

Pure: the host's free GPU memory and bf16 support come in as arguments; no torch, no NVML.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobspec.errors import SpecError, spec_error
from jobspec.units import MiB, fmt_mib_gib

if TYPE_CHECKING:
    from jobspec.memory.fit import FitResult
    from jobspec.memory.planner import MemoryPlan
    from jobspec.spec.derived import DerivedJob
    from jobspec.spec.validation import ResolvedSpec


@dataclass
class LaunchMemory:
    """What the launch decided about memory; `lines` are printed to the user."""

    plan: MemoryPlan | None = None      # the plan of the spec that runs, None if not plannable
    fit: FitResult | None = None        # when `memory.fit: auto` ran
    budget: int | None = None
    budget_source: str | None = None    # "memory.gpu_memory" | "free GPU memory" | the caller's (--gpu-mem)
    lines: list = field(default_factory=list)
    plan_error: SpecError | None = None  # why `plan` is None: the planner could not count the model
    host_budget: int | None = None      # a node's RAM
    host_budget_source: str | None = None   # "resources.host_mem" | "this host's RAM" | "--host-mem"
    host_problem: SpecError | None = None   # the node cannot hold its ranks' host memory (and what to change)


def plan_at_launch(resolved: ResolvedSpec, job: DerivedJob, gpu_free: int | None, *, bf16_supported: bool = True,
                   apply_fit: bool = True, budget: tuple[int, str] | None = None, host_ram: int | None = None,
                   host_budget: tuple[int, str] | None = None, gpu_name: str | None = None,
                   cpu_ranks: bool = False) -> tuple[ResolvedSpec, DerivedJob, LaunchMemory]:
    """(resolved spec to run, its derived job, LaunchMemory): `memory.fit: auto` applied, the plan of the result.
    `gpu_name`: this host's GPU (NVML's name), whose measured CUDA context the plan adds and whose
    measured speed prices the fit's candidates (memory/gpu_throughput.py);
    `cpu_ranks`: the ranks run on this host's CPUs, so the plan's host RAM holds their tensors (no
    GPU figure).

    `gpu_free`: the least free memory of this host's GPUs (None without GPUs), the budget when
    `memory.gpu_memory` is not set; `bf16_supported`: whether fitting may switch to bf16;
    `apply_fit=False`: the spec as written, whatever `memory.fit` says (`jobspec plan`); `budget`:
    (bytes, where from) replacing both (`jobspec plan --gpu-mem`). The host budget (a node's RAM):
    `host_budget` (`jobspec plan --host-mem`), else `resources.host_mem`, else `host_ram` (this host's
    RAM) when the job runs on one node.

    Nothing fits the budget -> SpecError (exit 2) with the smallest configuration's numbers; with
    `memory.fit: auto`, a node that cannot hold the plan's host memory too (at `resources.host_mem`,
    with what to change); without it, `host_problem` holds that error for the header's warning. A spec
    the fit changed is validated again, every rule (spec/validation.recheck): a change that breaks
    one is refused with the rule's own message, at the field.
    """
    from jobspec.memory.fit import apply_changes, fit, host_refusal
    from jobspec.memory.gpu_overheads import cuda_context, torch_cuda_version
    from jobspec.memory.planner import parse_bytes, plan_memory

    spec = resolved.spec
    memory = LaunchMemory()
    context = cuda_context(gpu_name, torch_cuda_version())   # the GPU's own figure, when measured
    if host_budget is not None:
        memory.host_budget, memory.host_budget_source = host_budget
    elif spec["resources"]["host_mem"]:
        memory.host_budget = parse_bytes(spec["resources"]["host_mem"], path=("resources", "host_mem"))
        memory.host_budget_source = "resources.host_mem"
    elif host_ram is not None and job.nodes == 1:
        memory.host_budget, memory.host_budget_source = host_ram, "this host's RAM"
    if budget is not None:
        memory.budget, memory.budget_source = budget
    elif spec["memory"]["gpu_memory"]:
        memory.budget, memory.budget_source = parse_bytes(spec["memory"]["gpu_memory"]), "memory.gpu_memory"
    else:
        if gpu_free is not None:
            memory.budget, memory.budget_source = gpu_free, "free GPU memory"
    if apply_fit and spec["memory"]["fit"] == "auto":
        if memory.budget is None:
            memory.lines.append("fit: skipped (memory.fit is auto, but this host has no GPU and "
                                "memory.gpu_memory is not set): running the spec as written")
        else:
            result = fit(spec, job, memory.budget, bf16_supported=bf16_supported, host_budget=memory.host_budget,
                         context=context, gpu=gpu_name)
            if result.host_limited:
                raise resolved.locate(spec_error(
                    f"memory.fit is auto and {result.reason}", path=("resources", "host_mem"),
                    hint=f"host budget from {memory.host_budget_source}; set resources.host_mem to the nodes' RAM, "
                         "or see `jobspec plan JOB --fit` for the breakdown"))
            if not result.fits:
                raise spec_error(f"memory.fit is auto and {result.reason}", path=("memory", "fit"),
                                 hint=f"budget from {memory.budget_source}; see `jobspec plan JOB --fit` "
                                      "for the breakdown, or set memory.fit: off to run as written")
            memory.fit = result
            memory.lines.append(f"fit: {result.reason} (budget {fmt_mib_gib(memory.budget)} from "
                                f"{memory.budget_source}; {result.considered} configurations considered)")
            if result.changes:
                spec = apply_changes(spec, result.changes)
                resolved = _rechecked(dataclasses.replace(resolved, spec=spec), result.overrides)
                job = job.with_spec(spec)
                memory.lines.append("fit: applied " + " ".join(f"--set {o}" for o in result.overrides))
    try:
        memory.plan = plan_memory(spec, job, budget=memory.budget, host_budget=memory.host_budget,
                                  context=context, cpu_ranks=cpu_ranks)
    except SpecError as err:  # an architecture the planner cannot count: launch anyway, unplanned
        if any(issue.code == "model-build" for issue in err.issues):
            raise resolved.locate(err) from None   # the model itself cannot be built: every rank would fail
        memory.plan_error = err
        memory.lines.append(f"memory plan unavailable ({err.issues[0].message}): no plan.* params, no "
                            "memory pre-flight")
    if memory.plan is not None and memory.plan.host_fits is False:
        memory.host_problem = resolved.locate(host_refusal(spec, job, memory.plan,
                                                           memory.host_budget_source or "the host budget"))
        if apply_fit and spec["memory"]["fit"] == "auto":   # auto refuses what it cannot make fit
            raise memory.host_problem
    return resolved, job, memory


def _rechecked(resolved: ResolvedSpec, overrides: list[str]) -> ResolvedSpec:
    """`resolved` (changed by the fit) through every validation rule again; a broken rule's issue
    says which changes the fit made."""
    from jobspec.spec.validation import recheck

    try:
        return recheck(resolved)
    except SpecError as err:
        applied = "memory.fit: auto applied " + " ".join(f"--set {o}" for o in overrides)
        raise SpecError([dataclasses.replace(issue, hint=f"{issue.hint}; {applied}" if issue.hint else applied)
                         for issue in err.issues]) from None


def preflight_problems(memory: LaunchMemory, free: int | None) -> list[str]:
    """The GPU memory check `--ignore-preflight` turns into a warning; none on a CPU-only host
    (`free` is None: the least free memory of this host's GPUs)."""
    plan = memory.plan
    if free is None or plan is None or plan.nvml_total <= free:
        return []
    return [(f"the plan predicts {fmt_mib_gib(plan.nvml_total)} per GPU (peak allocated "
             f"{fmt_mib_gib(plan.peak_allocated)}, reserved {fmt_mib_gib(plan.peak_reserved)}, plus the CUDA "
             f"context) but this host's GPU has {fmt_mib_gib(free)} free: "
             f"run `jobspec plan JOB --fit --gpu-mem {free // MiB}MiB` for settings that fit, "
             "or set memory.fit: auto")]


def plan_record(memory: LaunchMemory) -> dict:
    """launch.json's `plan` (MiB per component) and `fit` entries. CPU ranks have no GPU figure
    (their tensors are in `host_tensors_mib`, inside `host_total_mib`): memory/plan_figures."""
    record: dict[str, dict] = {}
    if memory.plan is not None:
        plan = memory.plan
        mib = {f"{k}_mib": _mib(v) for k, v in plan.breakdown.items()}
        if not plan.cpu_ranks:
            mib.update(peak_allocated_mib=_mib(plan.peak_allocated),
                       peak_reserved_mib=_mib(plan.peak_reserved),
                       nvml_total_mib=_mib(plan.nvml_total),
                       cuda_context_mib=_mib(plan.nvml_total - plan.peak_reserved))   # the one used
        mib.update(host_total_mib=_mib(plan.host_total),
                   host_per_node_mib=_mib(plan.host_per_node))
        mib.update({f"host_{k}_mib": _mib(v) for k, v in plan.host.items()})
        if memory.host_budget is not None:
            mib["host_budget_mib"] = _mib(memory.host_budget)
        if plan.nvme_total:
            mib["nvme_total_mib"] = _mib(plan.nvme_total)
        if memory.budget is not None:
            mib["budget_mib"] = _mib(memory.budget)
        record["plan"] = mib
    if memory.fit is not None and memory.budget is not None:   # a fit runs only with a budget
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


def _mib(n: float) -> float:
    return round(n / MiB, 1)
