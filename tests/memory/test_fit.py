"""`--fit`: the fastest settings predicted to fit a budget; the result must validate and compile."""
from __future__ import annotations

import pytest

from conftest import PROFILER, REPO_ROOT as REPO
from jobspec.cli import main
from jobspec.compile.compiler import compile_spec
from jobspec.memory.fit import fit, step_time
from jobspec.spec.derived import derive
from jobspec.memory.planner import parse_bytes, plan_memory
from jobspec.units import GiB
from jobspec.spec.validation import load_and_validate


def fitted(job: str, budget: str, **kwargs):
    spec = load_and_validate(REPO / "jobs" / job).spec
    derived = derive(spec, profiler=PROFILER)
    return spec, derived, fit(spec, derived, parse_bytes(budget), **kwargs)


@pytest.mark.parametrize("job,budget", [("gpt2-xl-12gb.yaml", "12GiB"), ("xlmr-large.yaml", "11GiB"),
                                        ("bert-large-1-vanilla.yaml", "8GiB"), ("gpt2-xl-12gb.yaml", "6GiB")])
def test_fit_finds_a_config_that_fits_validates_and_compiles(job, budget):
    spec, derived, result = fitted(job, budget)
    assert result.fits, result.reason
    assert result.plan.nvml_total <= parse_bytes(budget)
    # the overrides are real `--set` arguments: the spec they produce validates, compiles and
    # plans to the same numbers, with the global batch unchanged
    changed = load_and_validate(REPO / "jobs" / job, overrides=result.overrides).spec
    compiled = compile_spec(changed, derive(changed, profiler=PROFILER))
    original = compile_spec(spec, derived)
    assert compiled.derived.global_batch_size == original.derived.global_batch_size
    assert plan_memory(changed, derive(changed, profiler=PROFILER), budget=parse_bytes(budget)).nvml_total == result.plan.nvml_total
    assert f"of {budget[:-3]}" in result.reason and "x step time" in result.reason


def test_fit_prefers_the_written_spec_when_it_is_already_fastest_and_fits():
    spec, dims, result = fitted("bert-large-4-fp16.yaml", "80GiB")
    assert result.fits and result.changes == {} and result.slowdown == 1.0   # its own step time over itself


def test_fit_returns_the_cheapest_fitting_candidate():
    spec, derived, result = fitted("xlmr-large.yaml", "11GiB")
    from jobspec.memory.fit import apply_changes, candidate_changes
    budget = parse_bytes("11GiB")
    baseline = step_time(spec, derived)
    for changes in candidate_changes(spec, derived, True):
        candidate = apply_changes(spec, changes)
        if plan_memory(candidate, derive(candidate, profiler=PROFILER), budget=budget).fits:
            assert step_time(candidate, derive(candidate, profiler=PROFILER)) / baseline >= result.slowdown - 1e-9


def test_tighter_budgets_cost_more_time():
    slowdowns = [fitted("gpt2-xl-12gb.yaml", b)[2].slowdown for b in ("24GiB", "10GiB", "6GiB")]
    assert slowdowns == sorted(slowdowns) and slowdowns[0] < slowdowns[-1]


def test_fp16_instead_of_bf16_when_bf16_is_unsupported():
    _, _, result = fitted("bert-large-1-vanilla.yaml", "8GiB", bf16_supported=False)
    assert result.changes.get("memory.precision") in (None, "fp16")
    _, _, with_bf16 = fitted("bert-large-1-vanilla.yaml", "8GiB")
    assert with_bf16.changes.get("memory.precision") in (None, "bf16")


def test_nothing_fits_is_explained():
    _, _, result = fitted("gpt2-xl-12gb.yaml", "1GiB")
    assert not result.fits
    assert "nothing fits in 1.00 GiB" in result.reason and "more GPUs" in result.reason
    assert result.plan.nvml_total > GiB


def test_plan_fit_command(capsys):
    assert main(["plan", str(REPO / "jobs" / "gpt2-xl-12gb.yaml"), "--fit", "--gpu-mem", "12GiB"]) == 0
    out = capsys.readouterr().out
    assert "fit: " in out and "x step time" in out
    assert main(["plan", str(REPO / "jobs" / "gpt2-xl-12gb.yaml"), "--fit", "--gpu-mem", "1GiB"]) == 1
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("implementation, offloaded", [("fused", False), ("cpu", True)])
def test_fit_keeps_to_a_pinned_adam_implementation(implementation, offloaded):
    overrides = [f"training.optimizer.implementation={implementation}",
                 f"memory.offload.optimizer={'cpu' if offloaded else 'none'}"]
    spec = load_and_validate(REPO / "jobs" / "gpt2-xl-12gb.yaml", overrides=overrides).spec
    derived = derive(spec, profiler=PROFILER)
    from jobspec.memory.fit import apply_changes, candidate_changes
    for changes in candidate_changes(spec, derived, True):
        candidate = apply_changes(spec, changes)
        assert (candidate["memory"]["offload"]["optimizer"] != "none") == offloaded, changes
        compile_spec(candidate, derive(candidate, profiler=PROFILER))   # never the compiler's "cannot run with" error
