"""What the node launcher imports for its forked ranks (jobspec/train/preload.py): the run's model
code, MLflow where the run logs to it, and nothing that fails; a bad run directory changes nothing
but the time."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT

CHECK = ("import json, sys; from jobspec import rundir; from jobspec.train.preload import rank_imports; "
         "failed = rank_imports(rundir.read_resolved(sys.argv[1])); "
         "print(json.dumps({'failed': failed, 'loaded': [m for m in sys.argv[2:] if m in sys.modules]}))")
MODEL_CODE = "transformers.models.xlm_roberta.modeling_xlm_roberta"


def preload(run_dir, *modules) -> dict:
    done = subprocess.run([sys.executable, "-c", CHECK, str(run_dir), *modules], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_quickstart_run_gets_its_model_code_and_mlflow(tmp_path):
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "jobspec", "compile", str(REPO_ROOT / "jobs" / "quickstart.yaml"),
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    found = preload(out, MODEL_CODE, "mlflow", "jobspec.train.worker", "peft")
    assert found == {"failed": [], "loaded": [MODEL_CODE, "mlflow", "jobspec.train.worker"]}


def test_a_model_transformers_cannot_build_imports_the_rest(tmp_path):
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "jobspec", "compile", str(REPO_ROOT / "jobs" / "quickstart.yaml"),
                    "--out", str(out), "--set", "logging.mlflow.enabled=false"],
                   check=True, capture_output=True, timeout=300)
    resolved = (out / "resolved.yaml").read_text()
    (out / "resolved.yaml").write_text(resolved.replace("architecture: xlm-roberta",
                                                        "architecture: no-such-model"))
    found = preload(out, MODEL_CODE, "mlflow", "jobspec.train.worker")
    assert found == {"failed": ["model code"], "loaded": ["jobspec.train.worker"]}
