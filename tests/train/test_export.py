"""Model export on 2 CPU ranks: the quickstart job (shortened) under ZeRO-2, ZeRO-3 with CPU offload and
ZeRO-3 in bf16; `jobspec export` from mid-run checkpoints; `jobspec launch --from-run`.

Reference: the worker's test hook (JOBSPEC_EXPORT_REFERENCE) has every rank run the *engine* on a fixed
batch at each checkpoint and at the end, and saves the logits. The exported directory is loaded with
`AutoModelForSequenceClassification.from_pretrained` alone and run on the same batch: the weights went
through DeepSpeed's gather (or its zero_to_fp32 converter), safetensors and transformers' loader, none
of which the engine's forward uses. Three launches in all; each module fixture runs one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO_ROOT
from fp_bounds import forward_bound

pytestmark = pytest.mark.slow

REPO = REPO_ROOT
QUICKSTART = REPO / "jobs" / "quickstart.yaml"
SECRET = "hf_export_test_secret_99"
# the quickstart job, 6 steps: checkpoints (and a model export) at 3 and 6, evaluation at 3 and 6
SHORT = ["training.max_steps=6", "checkpoint.every_n_steps=3", "training.eval_every=3", "logging.every_n_steps=3",
         "logging.progress=lines", "export.at_checkpoints=true"]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def jobspec(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobspec", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def export(*args: str) -> None:
    """`jobspec export ...` in this process (its imports are paid once for the module), exit 0 expected."""
    from jobspec.cli import main
    assert main(["export", *args]) == 0


def run_dirs(output_dir: Path) -> list[Path]:
    return sorted(output_dir.glob("run-*"))


def reference(ref_dir: Path, name: str) -> dict:
    return torch.load(ref_dir / f"{name}.pt")


def exported_logits(model_dir: Path, ref: dict):
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits, model.dtype


def quickstart_forward_bound() -> float:
    """forward_bound of the model jobs/quickstart.yaml builds, from its sizes: 4.7e-4 at the time of writing."""
    import yaml
    job = yaml.safe_load(QUICKSTART.read_text())
    return forward_bound(job["model"]["config"], job["data"]["synthetic"]["seq_len"])


def assert_fp32_match(model_dir: Path, ref: dict) -> None:
    """The gathered (or converted) fp32 weights are copies of the engine's, so only the forward can differ:
    the same model code in another process, where a kernel may block its sums otherwise: forward_bound,
    4.7e-4 of max(1, max|logit|) (was 1e-5, which this bound always exceeds; typically bit-equal). A stale
    export (another step's weights) differs by > 1e-3 (test_zero2_exports_reproduce_the_engine checks it
    for step 3 vs 6), 2x this bound for logits of size <= 1."""
    logits, dtype = exported_logits(model_dir, ref)
    assert dtype == torch.float32
    bound = quickstart_forward_bound() * max(1.0, ref["logits"].abs().max().item())
    assert (logits - ref["logits"]).abs().max().item() <= bound


def assert_bf16_match(model_dir: Path, ref: dict, dtype=torch.bfloat16) -> None:
    """bf16 keeps 8 significant bits: logits agree to a few units of 2^-8 of their scale."""
    logits, got = exported_logits(model_dir, ref)
    assert got == dtype
    scale = max(1.0, ref["logits"].abs().max().item())
    assert (logits.float() - ref["logits"]).abs().max().item() <= 2 ** -6 * scale


def finished(proc: subprocess.CompletedProcess, code: int = 0) -> None:
    assert proc.returncode == code, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    """`jobspec launch` of the quickstart job, ZeRO-2 fp32, logged to a sqlite MLflow store."""
    root = tmp_path_factory.mktemp("zero2")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    proc = jobspec("launch", str(QUICKSTART), *sets(*SHORT, "memory.zero_stage=2", "export.best_eval=true",
                                                    f"output_dir={root / 'out'}", f"logging.mlflow.tracking_uri={uri}",
                                                    f"logging.mlflow.tags.note=token-{SECRET}"),
                   env={"JOBSPEC_EXPORT_REFERENCE": str(root / "ref"), "HF_TOKEN": SECRET})
    finished(proc)
    (run_dir,) = run_dirs(root / "out")
    return SimpleNamespace(root=root, uri=uri, run_dir=run_dir, proc=proc, ref=root / "ref",
                           run_id=json.loads((run_dir / "mlflow_run.json").read_text())["run_id"],
                           ckpt=root / "out" / "checkpoints")


@pytest.fixture(scope="module")
def zero3_child(zero2):
    """`jobspec launch --from-run` of zero2's run, as ZeRO-3 with CPU offload of parameters and optimizer,
    with a full disk (injected) when the final model is written."""
    ref = zero2.root / "ref3"
    proc = jobspec("launch", "--from-run", zero2.run_id, "--tracking-uri", zero2.uri,
                   *sets("memory.zero_stage=3", "memory.offload.optimizer=cpu", "memory.offload.params=cpu",
                         "memory.offload.pin_memory=false"),
                   env={"JOBSPEC_EXPORT_REFERENCE": str(ref), "JOBSPEC_INJECT_EXPORT_ERROR": "final:ENOSPC"})
    (run_dir,) = [d for d in run_dirs(zero2.root / "out") if d != zero2.run_dir]
    return SimpleNamespace(proc=proc, run_dir=run_dir, ref=ref,
                           run_id=json.loads((run_dir / "mlflow_run.json").read_text())["run_id"])


@pytest.fixture(scope="module")
def zero3_bf16(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3bf16")
    proc = jobspec("launch", str(QUICKSTART), *sets(*SHORT, "memory.zero_stage=3", "memory.precision=bf16",
                                                    "logging.mlflow.enabled=false", f"output_dir={root / 'out'}"),
                   env={"JOBSPEC_EXPORT_REFERENCE": str(root / "ref")})
    finished(proc)
    (run_dir,) = run_dirs(root / "out")
    return SimpleNamespace(root=root, run_dir=run_dir, ref=root / "ref", ckpt=root / "out" / "checkpoints")


# --- ZeRO-2, fp32 -------------------------------------------------------------------------------------

def test_zero2_exports_reproduce_the_engine(zero2):
    model = zero2.run_dir / "model"
    assert sorted(p.name for p in model.iterdir()) == ["best", "final", "step3"]   # step6 is `final`
    assert_fp32_match(model / "final", reference(zero2.ref, "final"))
    assert_fp32_match(model / "step3", reference(zero2.ref, "step3"))
    best_step = json.loads((model / "best" / "jobspec_export.json").read_text())["step"]
    assert_fp32_match(model / "best", reference(zero2.ref, "final" if best_step == 6 else f"step{best_step}"))
    # the weights changed between the two: the comparison can tell a stale export
    assert (reference(zero2.ref, "final")["logits"] - reference(zero2.ref, "step3")["logits"]).abs().max() > 1e-3


def test_jobspec_export_from_a_mid_run_checkpoint_and_in_bf16(zero2, tmp_path):
    export(str(zero2.ckpt / "step3"), "--out", str(tmp_path / "step3"))
    assert_fp32_match(tmp_path / "step3", reference(zero2.ref, "step3"))
    export(str(zero2.run_dir), "--out", str(tmp_path / "bf16"), "--dtype", "bf16")
    assert_bf16_match(tmp_path / "bf16", reference(zero2.ref, "final"))
    refused = jobspec("export", str(zero2.run_dir), "--out", str(tmp_path / "bf16"))
    assert refused.returncode == 2 and "is not empty" in refused.stderr and "Traceback" not in refused.stderr


def test_zero2_records_the_models_in_summary_and_mlflow(zero2, tmp_path):
    from mlflow import MlflowClient
    summary = json.loads((zero2.run_dir / "summary.json").read_text())
    assert set(summary["exports"]) == {"final", "best", "step3"}
    final = summary["exports"]["final"]
    assert (final["path"], final["step"], final["dtype"]) == (str(zero2.run_dir / "model" / "final"), 6, "fp32")
    client = MlflowClient(tracking_uri=zero2.uri)
    run = client.get_run(zero2.run_id)
    assert run.data.tags["jobspec.export.final"] == final["path"]
    assert run.data.tags["jobspec.export.final.artifact"] == "model/final"
    uploaded = {a.path for a in client.list_artifacts(zero2.run_id, "model/final")}
    assert {"model/final/config.json", "model/final/model.safetensors", "model/final/README.md"} <= uploaded
    card = Path(client.download_artifacts(zero2.run_id, "model/final/README.md", str(tmp_path))).read_text()
    assert SECRET not in card and "note: token-***" in card
    assert f"| eval/loss | {summary['eval_loss']:.6g} |" in card


# --- ZeRO-3 with CPU offload, launched again from the MLflow run, full disk at the end ---------------

@pytest.mark.jit_ops("CPUAdamBuilder")   # zero3_child: optimizer offload
def test_from_run_child_is_tagged_and_keeps_the_parents_checkpoints(zero2, zero3_child):
    import yaml
    from mlflow import MlflowClient
    run = MlflowClient(tracking_uri=zero2.uri).get_run(zero3_child.run_id)
    assert zero3_child.run_id != zero2.run_id
    assert run.data.tags["jobspec.parent_run_id"] == zero2.run_id
    assert "mlflow.parentRunId" not in run.data.tags
    child_ckpt = yaml.safe_load((zero3_child.run_dir / "resolved.yaml").read_text())["checkpoint"]["dir"]
    assert child_ckpt.startswith(f"{zero2.ckpt}-from-{zero2.run_id[:8]}-")
    assert (zero2.ckpt / "latest").read_text() == "step6"   # the parent's checkpoints: untouched
    assert f"from run {zero2.run_id}: checkpoint.dir" in zero3_child.proc.stdout


@pytest.mark.jit_ops("CPUAdamBuilder")   # zero3_child: optimizer offload
def test_full_disk_at_the_end_is_one_line_exit_1_and_loses_no_checkpoint(zero2, zero3_child):
    import yaml
    from mlflow import MlflowClient

    from jobspec.checkpoint.save_load import read_latest, verify
    proc = zero3_child.proc
    finished(proc, 1)
    output = proc.stdout + proc.stderr
    final_dir = zero3_child.run_dir / "model" / "final"
    ckpt = Path(yaml.safe_load((zero3_child.run_dir / "resolved.yaml").read_text())["checkpoint"]["dir"])
    errors = [line[line.index("ERROR: "):] for line in output.splitlines() if "ERROR: " in line]
    assert errors == [f"ERROR: cannot write the model directory {final_dir}: No space left on device; the "
                      f"checkpoints in {ckpt} are intact (`jobspec export` converts one later)"]
    assert "Traceback" not in output
    summary = json.loads((zero3_child.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and errors[0].endswith(summary["error"])
    assert read_latest(ckpt) == "step6" and verify(ckpt, "step6") is None
    assert not final_dir.exists() and not [p for p in final_dir.parent.iterdir() if p.name.startswith(".")]
    assert MlflowClient(tracking_uri=zero2.uri).get_run(zero3_child.run_id).info.status == "FAILED"


@pytest.mark.jit_ops("CPUAdamBuilder")   # zero3_child: optimizer offload
def test_zero3_offload_exports_reproduce_the_engine(zero3_child, tmp_path):
    # the rank-side export at the step-3 checkpoint: DeepSpeed's gather of offloaded parameters
    assert_fp32_match(zero3_child.run_dir / "model" / "step3", reference(zero3_child.ref, "step3"))
    # the final model the full disk refused: converted from the checkpoint that was kept
    export(str(zero3_child.run_dir), "--out", str(tmp_path / "final"))
    assert_fp32_match(tmp_path / "final", reference(zero3_child.ref, "final"))


# --- ZeRO-3, bf16 -------------------------------------------------------------------------------------

def test_zero3_bf16_exports(zero3_bf16, tmp_path):
    final = zero3_bf16.run_dir / "model" / "final"
    assert json.loads((final / "jobspec_export.json").read_text())["dtype"] == "bf16"   # auto: the 16-bit type
    assert_bf16_match(final, reference(zero3_bf16.ref, "final"))
    assert_bf16_match(zero3_bf16.run_dir / "model" / "step3", reference(zero3_bf16.ref, "step3"))
    # fp32 master weights of the mid-run checkpoint, merged by DeepSpeed's converter
    export(str(zero3_bf16.ckpt / "step3"), "--out", str(tmp_path / "fp32"), "--dtype", "fp32")
    assert_bf16_match(tmp_path / "fp32", reference(zero3_bf16.ref, "step3"), dtype=torch.float32)
    from safetensors.torch import load_file
    masters = load_file(tmp_path / "fp32" / "model.safetensors")
    # genuine fp32 masters, not 16-bit weights widened: some do not survive a bf16 round trip
    assert any((t != t.bfloat16().float()).any() for t in masters.values() if t.is_floating_point())


# --- without a launch: the start-of-run writability probe, `jobspec export` offline ---------------------

def exporter(tmp_path: Path, export_dir: Path, **export):
    from conftest import TINY_SPEC, deep_merge

    from jobspec.spec.schema import fill_defaults
    from jobspec.export.exporter import ModelExporter
    spec = fill_defaults(deep_merge(TINY_SPEC, {"export": {"dir": str(export_dir), **export},
                                                "checkpoint": {"dir": str(tmp_path / "ckpt")}}))
    from jobspec.spec.derived import DerivedJob, derive
    # launch.json's derived job, as the ranks read it (DerivedJob.from_dict)
    derived = {**derive(spec).as_dict(), "total_steps": 8, "world_size": 1}
    made = ModelExporter(spec, DerivedJob.from_dict(derived), tmp_path / "run", rank=0, group=None,
                         progress=None)
    made._broadcast = lambda obj: obj  # one rank: rank 0's outcome is everyone's
    return made


@pytest.mark.parametrize("where", ["the export dir", "a parent of it"])
def test_check_writable_refuses_an_export_dir_that_is_a_file(tmp_path, where):
    from jobspec.export.hf_dir import ExportFailed
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    base = taken if where == "the export dir" else taken / "models"
    with pytest.raises(ExportFailed) as err:
        exporter(tmp_path, base).check_writable()
    assert str(err.value) == (f"cannot write the model directory {base}: {taken} is a file, not a directory; the "
                              f"checkpoints in {tmp_path / 'ckpt'} are intact (`jobspec export` converts one later)")
    exporter(tmp_path, base, final=False).check_writable()  # nothing to export: nothing to probe


def test_check_writable_refuses_a_directory_it_cannot_write(tmp_path, monkeypatch):
    from jobspec.export.hf_dir import ExportFailed
    base = tmp_path / "models"
    base.mkdir()
    base.chmod(0o500)
    if os.geteuid() == 0:  # root writes through 0o500 (tests run as root here): fail the probe as for a user
        def refused(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "write_text", refused)
    with pytest.raises(ExportFailed, match=f"^cannot write the model directory {base}: Permission denied; "):
        exporter(tmp_path, base).check_writable()
    base.chmod(0o700)
    monkeypatch.undo()
    exporter(tmp_path, base / "new").check_writable()  # a writable place: made, probed, left empty
    assert list((base / "new").iterdir()) == []


def test_jobspec_export_converts_with_the_hub_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    from jobspec.cli import main
    from jobspec.export import from_checkpoint
    for key in from_checkpoint.OFFLINE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    seen = {}

    def fake_export(source, out, dtype, show_progress):  # what transformers/huggingface_hub see meanwhile
        seen.update({key: os.environ.get(key) for key in from_checkpoint.OFFLINE_ENV}, flag=hub.HF_HUB_OFFLINE)
        return {"path": str(out), "bytes": 0, "dtype": "fp32", "step": 3, "seconds": 0.0}
    monkeypatch.setattr(from_checkpoint, "locate", lambda source, spec: from_checkpoint.Source(tmp_path / "ckpt", "step3", {}, None))
    monkeypatch.setattr(from_checkpoint, "export_checkpoint", fake_export)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model")]) == 0
    assert seen == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "flag": True}
    assert not any(key in os.environ for key in from_checkpoint.OFFLINE_ENV) and hub.HF_HUB_OFFLINE is False  # restored
