"""One path from a spec file to the job that runs: load, validate, derive, the memory decisions,
compile.

    prepare_job(path, overrides, host, how)
        -> PreparedJob(resolved, derived, memory, compiled, host)

`how` (a Preparation; COMPILE, PLANNED, AS_WRITTEN name the usual ones) says how far: the memory
plan or not, memory.fit applied or not, which budgets, compiled for which run directory or not.

    resolve    spec/validation.load_and_validate: every problem at once (SpecError, exit 2)
    checks     the caller's, on the resolved spec before anything is derived (launch: the hub's
               reachability, bitsandbytes' backend on CPU ranks); then job/checks.model_data_checks,
               the same model and data refusals for every command (model.config of a hub id, the
               config transformers builds, the tokenizer and chat template), and the LoRA targets;
               skipped for a spec the plan cache marks as checked (job/checks.checks_passed)
    derive     spec/inputs.derive_job; with the model's traced profile when memory is planned
               (memory/plan_cache.CachedProfiler: the plan cache, else the tracer)
    memory     memory/at_launch.plan_at_launch: `memory.fit: auto` rewrites the spec and its
               derived job (and every validation rule runs again on the result), the plan of what
               runs
    compile    compile/compiler.compile_spec: the DeepSpeed config, patches and argv

`jobspec compile`, `plan`, `launch` (dry and real), `prepare` (launch/job_ops) and `report` go
through it, so each of them sees the job the others see: `compile` shows the config `launch` runs.
The host's numbers (free GPU memory, bf16 support) come in as a `hardware.Host`; `Host.probe` reads
this machine's. Light: no torch at module level (the profiler imports it when memory is planned).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from jobspec.compile.compiler import Compiled, compile_spec
from jobspec.hardware import Host
from jobspec.memory import at_launch
from jobspec.memory.at_launch import LaunchMemory
from jobspec.spec.derived import DerivedJob
from jobspec.spec.inputs import derive_job
from jobspec.spec.types import JobSpec
from jobspec.spec.validation import ResolvedSpec, load_and_validate


@dataclass
class PreparedJob:
    """A job ready to run: the spec that runs (after `memory.fit: auto`), its derived job, the
    memory decisions (None when memory was not planned), its compiled config (None when not
    compiled)."""

    resolved: ResolvedSpec
    derived: DerivedJob
    memory: LaunchMemory | None = None
    compiled: Compiled | None = None
    host: Host | None = None

    @property
    def spec(self) -> JobSpec:
        return self.resolved.spec

    def compile(self, run_dir: str | os.PathLike = "RUN_DIR",
                master_port: int | None = None) -> Compiled:
        """The compiled config, patches and launch plan of this job for a run directory and port."""
        return compile_spec(self.resolved.spec, self.derived, run_dir=str(run_dir),
                            master_port=master_port)

    def in_checkpoint_dir(self, checkpoint_dir: str | os.PathLike) -> PreparedJob:
        """This job training into `checkpoint_dir` (a --new-run's, or an earlier one's); not
        compiled."""
        if Path(self.spec["checkpoint"]["dir"]) == Path(checkpoint_dir):
            return self
        spec: JobSpec = {**self.spec,
                         "checkpoint": {**self.spec["checkpoint"], "dir": str(checkpoint_dir)}}
        return dataclasses.replace(self, resolved=dataclasses.replace(self.resolved, spec=spec),
                                   derived=self.derived.with_spec(spec), compiled=None)


@dataclass(frozen=True)
class Preparation:
    """What a command asks of prepare_job beyond the spec and the host (the presets below name the
    usual ones).

    `plan`: derive with the model's traced profile and plan the memory (launch, plan, prepare,
    report); without it memory is decided only when `memory.fit: auto` may rewrite the spec (a
    budget is known), as the compiled config depends on it. `apply_fit=False` keeps the spec as
    written (`jobspec plan`, report); `budget`: (bytes, where from) replacing `memory.gpu_memory`
    and the free GPU memory; `host_budget`: the same for a node's RAM (`resources.host_mem`, the
    host's). `run_dir`: compile for this run directory and `master_port` (None: not compiled;
    PreparedJob.compile does it later).
    """

    plan: bool = False
    apply_fit: bool = True
    budget: tuple[int, str] | None = None
    host_budget: tuple[int, str] | None = None
    run_dir: str | None = "RUN_DIR"
    master_port: int | None = None


# `jobspec compile`: the config that runs
COMPILE = Preparation()
# launch: the memory plan, compiled per run dir
PLANNED = Preparation(plan=True, run_dir=None)
# plan, report: memory.fit not applied
AS_WRITTEN = Preparation(plan=True, apply_fit=False, run_dir=None)


def prepare_job(source: str | os.PathLike | ResolvedSpec, overrides: Iterable[str] = (),
                host: Host | None = None,
                how: Preparation = COMPILE, *,
                checks: Iterable[Callable[[ResolvedSpec], None]] = ()) -> PreparedJob:
    """The job a spec file (or an already resolved spec) describes, as `jobspec launch` would run
    it, prepared as `how` says (COMPILE, PLANNED, AS_WRITTEN or a Preparation of its own).

    `host`: the machine's numbers (None: `Host.probe` of this one, read only when memory is
    decided). `checks`: called with the resolved spec before anything is derived, then the model and
    data refusals every command makes alike (job/checks).

    Raises SpecError (exit 2): the spec's problems, a check's, nothing fitting the budget, a fit
    change that breaks a rule, a compile refusal.
    """
    resolved = source if isinstance(source, ResolvedSpec) \
        else load_and_validate(source, list(overrides))
    for check in checks:
        check(resolved)
    from jobspec.job import checks as job_checks
    full = how.plan or spec_fits(resolved.spec, how.apply_fit, how.budget)
    passed = job_checks.checks_passed(resolved.spec)   # an earlier plan or launch of this spec
    job_checks.model_data_checks(resolved, plan=full, passed=passed)
    if resolved.spec["model"]["lora"] is not None and not passed:
        job_checks.lora_target_check(resolved)   # the target patterns against the model's modules
    if full and not passed:
        job_checks.record_checks(resolved.spec)
    spec = resolved.spec
    memory = None
    plan = how.plan
    if not plan and how.apply_fit and spec["memory"]["fit"] == "auto" and how.budget is None \
            and not spec["memory"]["gpu_memory"]:
        host = host or Host.probe(spec["resources"]["gpus_per_node"])
        plan = host.gpu_free is not None   # a budget: the fit may rewrite the spec, so decide it
    if plan or spec_fits(spec, how.apply_fit, how.budget):
        from jobspec.memory.plan_cache import CachedProfiler
        host = host or Host.probe(spec["resources"]["gpus_per_node"])
        derived = resolved.located(lambda: derive_job(spec, profiler=CachedProfiler()))
        resolved, derived, memory = resolved.located(lambda: at_launch.plan_at_launch(
            resolved, derived, host.gpu_free, bf16_supported=host.bf16_supported,
            apply_fit=how.apply_fit,
            budget=how.budget, host_ram=host.ram_total, host_budget=how.host_budget,
            gpu_name=host.gpu_name, cpu_ranks=host.cpu_ranks))
    else:
        derived = resolved.located(lambda: derive_job(spec))
    prepared = PreparedJob(resolved, derived, memory, host=host)
    if how.run_dir is not None:
        prepared.compiled = prepared.compile(how.run_dir, how.master_port)
    return prepared


def spec_fits(spec: JobSpec, apply_fit: bool, budget) -> bool:
    """Whether `memory.fit: auto` will be decided with a known budget (then the model is built and
    traced)."""
    return apply_fit and spec["memory"]["fit"] == "auto" \
        and bool(budget or spec["memory"]["gpu_memory"])


