"""job/prepare.prepare_job: the one path from a spec file to the job that runs, taken by `compile`,
`plan`, `launch` (dry and real), `prepare` (launch/job_ops) and `report`; after `memory.fit: auto`
rewrites a spec, every validation rule runs again."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import spec_builder
import yaml

from jobspec import hardware
from jobspec.cli import main
from jobspec.errors import SpecError
from jobspec.job import prepare as prepare_module
from jobspec.hardware import Host
from jobspec.job.prepare import PreparedJob, prepare_job
from jobspec.launch import supervise
from jobspec.memory.gpu_overheads import cuda_context
from jobspec.memory.planner import parse_bytes
from jobspec.units import MiB

# tests/launch/test_fit_launch.py: as written this job needs more; a smaller micro-batch fits (the
# CUDA context a plan adds for a GPU it does not know, and 10 MiB)
FIT_BUDGET = f"{cuda_context(None, None).bytes // MiB + 10}MiB"


def write_job(tmp_path: Path, memory: dict | None = None, training: dict | None = None) -> Path:
    spec = {
        "name": "prepared",
        "model": {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2,
                                                     "num_attention_heads": 2, "intermediate_size": 256,
                                                     "vocab_size": 512, "max_position_embeddings": 512}},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 256}, "num_workers": 0, "pin_memory": False},
        "training": {"max_steps": 4, "micro_batch_size": 16, **(training or {})},
        "memory": memory or {},
        "resources": {"gpus_per_node": 2},
        "output_dir": "out",
        "logging": {"progress": "lines", "mlflow": {"enabled": False}},
    }
    return spec_builder.write_job(tmp_path, base=spec, filename="prepared.yaml")


@pytest.fixture(autouse=True)
def no_fake_gpu(monkeypatch):
    monkeypatch.delenv(hardware.FAKE_FREE_ENV, raising=False)


@pytest.fixture
def calls(monkeypatch):
    """Every prepare_job call, by the keyword arguments that shape it."""
    seen = []
    real = prepare_module.prepare_job

    def spy(*args, **kwargs):
        prepared = real(*args, **kwargs)
        seen.append(prepared)
        return prepared
    monkeypatch.setattr(prepare_module, "prepare_job", spy)
    return seen


def test_compile_and_a_dry_run_show_the_same_fitted_config(tmp_path, monkeypatch, capsys, calls):
    job = write_job(tmp_path, {"fit": "auto", "gpu_memory": FIT_BUDGET})
    assert main(["compile", str(job)]) == 0
    captured = capsys.readouterr()
    compiled = json.loads(captured.out)
    assert "note: fit: applied --set training.micro_batch_size=" in captured.err
    assert compiled["train_micro_batch_size_per_gpu"] < 16 and compiled["train_batch_size"] == 32

    monkeypatch.setattr(supervise, "run", lambda *a, **k: pytest.fail("dry run started the runner"))
    assert main(["launch", str(job), "--dry-run"]) == 0
    assert json.dumps(compiled, indent=2) in capsys.readouterr().out
    assert len(calls) == 2 and calls[0].compiled.ds_config == compiled
    assert calls[0].memory.fit.changes == calls[1].memory.fit.changes


def test_compile_out_writes_the_fitted_spec(tmp_path, capsys):
    job = write_job(tmp_path, {"fit": "auto", "gpu_memory": FIT_BUDGET})
    assert main(["compile", str(job), "--out", str(tmp_path / "c")]) == 0
    resolved = yaml.safe_load((tmp_path / "c" / "resolved.yaml").read_text())
    ds_config = json.loads((tmp_path / "c" / "ds_config.json").read_text())
    assert resolved["training"]["micro_batch_size"] == ds_config["train_micro_batch_size_per_gpu"] < 16


def test_fit_off_compiles_without_tracing_the_model(tmp_path, monkeypatch):
    from jobspec.memory import plan_cache
    monkeypatch.setattr(plan_cache.CachedProfiler, "__init__",
                        lambda *a, **k: pytest.fail("profiled a job whose memory is not decided"))
    prepared = prepare_job(write_job(tmp_path), host=Host())
    assert prepared.memory is None and prepared.compiled.ds_config["train_micro_batch_size_per_gpu"] == 16
    # memory.fit: auto with no budget at all (no memory.gpu_memory, no GPU): the spec as written
    prepared = prepare_job(write_job(tmp_path, {"fit": "auto"}), host=Host(gpu_free=None))
    assert prepared.memory is None and prepared.compiled.ds_config["train_micro_batch_size_per_gpu"] == 16


def test_the_host_is_an_argument(tmp_path):
    job = write_job(tmp_path, {"fit": "auto"})
    roomy = prepare_job(job, host=Host(gpu_free=parse_bytes("80GiB")))
    assert roomy.memory.fit.changes == {"memory.precision": "bf16"}   # faster, and it fits
    assert roomy.memory.budget_source == "free GPU memory" and roomy.compiled.ds_config["bf16"]["enabled"]
    no_bf16 = prepare_job(job, host=Host(gpu_free=parse_bytes("80GiB"), bf16_supported=False))
    assert no_bf16.memory.fit.changes == {"memory.precision": "fp16"}
    tight = prepare_job(job, host=Host(gpu_free=parse_bytes(FIT_BUDGET)))
    assert tight.memory.fit.changes["training.micro_batch_size"] < 16
    assert tight.spec["training"]["micro_batch_size"] == tight.derived.micro_batch_size \
        == tight.compiled.ds_config["train_micro_batch_size_per_gpu"]


def test_every_command_path_prepares_through_it(tmp_path, monkeypatch, capsys, calls):
    from jobspec.launch.job_ops import job_ops
    from jobspec.report.table import predicted_peak_mib

    job = write_job(tmp_path)
    assert main(["plan", str(job), "--gpu-mem", "4GiB", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert calls[-1].memory.budget_source == "--gpu-mem" and calls[-1].compiled is None
    assert job_ops(str(job), []) == [] and calls[-1].compiled is not None
    peak = predicted_peak_mib(calls[0].spec)
    assert peak == plan["peak_allocated"] / 2**20   # the same plan by both paths: the same bytes, one division
    assert len(calls) == 3


def test_plan_shows_the_spec_as_written_even_with_fit_auto(tmp_path, capsys, calls):
    job = write_job(tmp_path, {"fit": "auto", "gpu_memory": FIT_BUDGET})
    assert main(["plan", str(job)]) == 0   # the written spec does not fit; what memory.fit: auto runs does
    out = capsys.readouterr().out
    assert "(as written)" in out and "does NOT fit" in out and "memory.fit: auto: " in out
    assert calls[0].memory.fit is None and calls[0].spec["training"]["micro_batch_size"] == 16


def fit_adding(fit_module, extra: dict):
    """memory.fit's search, with `extra` (dotted key -> value) added to whatever it changes."""
    real_fit = fit_module.fit

    def fit(spec, job, budget, **kwargs):
        result = real_fit(spec, job, budget, **kwargs)
        changes = {**result.changes, **extra}
        return dataclasses.replace(result, changes=changes, overrides=fit_module.to_overrides(changes))
    return fit


def test_a_fit_change_that_breaks_a_rule_is_refused_with_the_rules_message(tmp_path, monkeypatch):
    # implementation chooses the Adam of `adamw`: a fit that switched to 8-bit AdamW breaks that rule
    from jobspec.memory import fit as fit_module
    job = write_job(tmp_path, {"fit": "auto", "gpu_memory": FIT_BUDGET},
                    training={"optimizer": {"implementation": "torch"}})
    monkeypatch.setattr(fit_module, "fit", fit_adding(fit_module, {"training.optimizer.name": "adamw_8bit"}))
    with pytest.raises(SpecError) as caught:
        prepare_job(job, host=Host())
    [issue] = caught.value.issues
    assert issue.path == ("training", "optimizer", "implementation") and issue.code == "adam-settings"
    assert issue.message == "`implementation` chooses the Adam of `adamw`, not of `adamw_8bit`"
    assert "memory.fit: auto applied --set" in issue.hint and "training.optimizer.name=adamw_8bit" in issue.hint
    written = next(n for n, line in enumerate(job.read_text().splitlines(), 1) if "implementation:" in line)
    assert (issue.file, issue.line) == (str(job), written)   # the written field


@pytest.mark.parametrize("memory, codes", [
    ({"zero_stage": 2, "offload": {"params": "cpu"}}, ["offload-params-stage"]),
    ({"zero_stage": 0, "offload": {"optimizer": "cpu"}}, ["offload-optimizer-stage"]),
    ({"zero_stage": 2, "offload": {"params": "nvme", "optimizer": "nvme"}},
     ["offload-params-stage", "offload-nvme-path"]),
])
def test_offload_rules_refuse_a_spec_changed_after_validation_at_the_field(tmp_path, memory, codes):
    """What the compiler used to repeat ("a spec built without validation stops here"): the offload
    rules run again on a spec changed after validation, with validation's words, positioned."""
    from jobspec.spec.rules.offload import offload_problems
    from jobspec.spec.validation import load_and_validate, recheck
    job = write_job(tmp_path)
    resolved = load_and_validate(job)
    spec = json.loads(json.dumps(resolved.spec))
    for key, value in memory.items():
        spec["memory"][key] = {**spec["memory"][key], **value} if isinstance(value, dict) else value
    with pytest.raises(SpecError) as caught:
        recheck(dataclasses.replace(resolved, spec=spec))
    expected = offload_problems(spec["memory"])
    assert expected and [(i.path, i.message, i.hint) for i in caught.value.issues] == expected
    assert [i.code for i in caught.value.issues] == codes
    assert all(i.file == str(job) and i.line for i in caught.value.issues)


@pytest.mark.parametrize("implementation, offload, phrase", [
    ("fused", "cpu", "cannot run with optimizer offload"),
    ("cpu", "none", "needs optimizer offload"),
])
def test_an_adam_implementation_the_changed_offload_cannot_run_is_refused(tmp_path, implementation, offload, phrase):
    from jobspec.spec.validation import load_and_validate, recheck
    written = "none" if offload == "cpu" else "cpu"
    resolved = load_and_validate(write_job(tmp_path, {"zero_stage": 2, "offload": {"optimizer": written}},
                                           training={"optimizer": {"implementation": implementation}}))
    spec = json.loads(json.dumps(resolved.spec))
    spec["memory"]["offload"]["optimizer"] = offload    # as memory.fit would change it
    with pytest.raises(SpecError) as caught:
        recheck(dataclasses.replace(resolved, spec=spec))
    [issue] = caught.value.issues
    assert phrase in issue.message and issue.path == ("training", "optimizer", "implementation")


def test_an_adam_implementation_a_fit_offload_cannot_run_is_refused_once(tmp_path, monkeypatch):
    """The refusal is adamw's rule alone (optimizers/adamw.issues), run again on the fitted spec; the
    compiler no longer repeats it: one issue, coded, at the written field, and nothing compiled."""
    from jobspec.memory import fit as fit_module
    job = write_job(tmp_path, {"fit": "auto", "gpu_memory": FIT_BUDGET, "zero_stage": 2},
                    training={"optimizer": {"implementation": "fused"}})
    monkeypatch.setattr(fit_module, "fit", fit_adding(fit_module, {"memory.offload.optimizer": "cpu"}))
    compiled = []
    monkeypatch.setattr(prepare_module, "compile_spec", lambda *a, **k: compiled.append(a))
    with pytest.raises(SpecError) as caught:
        prepare_job(job, host=Host())
    [issue] = caught.value.issues
    assert issue.path == ("training", "optimizer", "implementation") and issue.code == "adam-settings"
    assert "`fused` Adam cannot run with optimizer offload" in issue.message
    assert issue.file == str(job) and compiled == []


def test_a_written_spec_passes_the_recheck_unchanged():
    from jobspec.spec.validation import load_and_validate, recheck
    for job in sorted((Path(__file__).resolve().parent.parent / "jobs").glob("*.yaml")):
        resolved = load_and_validate(job)
        before = json.dumps(resolved.spec, sort_keys=True)
        assert recheck(resolved) is resolved and json.dumps(resolved.spec, sort_keys=True) == before


def test_in_checkpoint_dir(tmp_path):
    prepared = prepare_job(write_job(tmp_path), host=Host())
    assert prepared.in_checkpoint_dir(prepared.spec["checkpoint"]["dir"]) is prepared
    moved = prepared.in_checkpoint_dir(tmp_path / "elsewhere")
    assert isinstance(moved, PreparedJob) and moved.compiled is None
    assert moved.spec["checkpoint"]["dir"] == str(tmp_path / "elsewhere")
    assert prepared.spec["checkpoint"]["dir"] != str(tmp_path / "elsewhere")
