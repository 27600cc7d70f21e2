"""What a rank of a run imports before its first step, imported ahead of it: DeepSpeed's node
launcher calls the rank module's `preload` (jobspec.train.worker.preload: `rank_imports`) once and
forks its ranks from there (jobspec/launch/rank_forks.py), so each starts with torch, DeepSpeed,
jobspec's training side, the model's transformers code and, where the run logs to it, MLflow
already imported.

Only imports: nothing here creates a thread, a tensor or a process group (a fork would not carry a
thread over, and a pool started before it is broken in the child). A failure here changes nothing
but the time: the rank imports the module again itself, and reports the error where it always
does.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

from jobspec import ops
from jobspec.spec import model_table
from jobspec.spec.types import JobSpec
from jobspec.tracking.run import import_mlflow
from jobspec.train import library_output

# every rank's own modules, and what they import at the top (torch, DeepSpeed, numpy)
RANK_MODULES = ("jobspec.train.worker", "jobspec.train.assembly", "jobspec.train.engine",
                "jobspec.train.trainer", "jobspec.train.patches", "jobspec.model.build",
                "jobspec.data.loaders")


def rank_imports(spec: JobSpec) -> list[str]:
    """Import what a rank of a run of `spec` imports; the steps that failed."""
    library_output.before_imports(0)   # progress bars off before transformers & co. are imported
    failed = []
    for label, step in _steps(spec):
        try:
            step()
        except Exception:  # noqa: BLE001 -- see the module doc
            failed.append(label)
    return failed


def _steps(spec: JobSpec) -> list[tuple[str, Callable[[], object]]]:
    """(what a failure is called, the step) in order: the libraries' log routing first, so what
    they log as they are imported goes where rank 0's would (launcher.log)."""
    steps: list[tuple[str, Callable[[], object]]] = [
        ("library logs", partial(library_output.route_library_logs, 0,
                                 transformers=spec["model"]["architecture"] != "mlp",
                                 datasets=bool(spec["data"]["train"])))]
    steps += [(name, partial(importlib.import_module, name))
              for name in (*RANK_MODULES, *_run_modules(spec))]
    if spec["logging"]["mlflow"]["enabled"]:   # rank 0's metric sink
        steps.append(("mlflow", import_mlflow))
    steps.append(("model code", partial(_import_model_code, spec)))
    # read once here (a subprocess of py-cpuinfo's), not by each rank's op loads
    steps.append(("cpu info", _read_cpu_info))
    return steps


def _read_cpu_info() -> None:
    ops.share_cpu_info(None)
    importlib.import_module("cpuinfo").get_cpu_info()


def _run_modules(spec) -> list[str]:
    names = []
    if spec["logging"]["mlflow"]["enabled"]:
        names.append("jobspec.tracking.mlflow_tracker")
    if spec["data"]["train"]:
        names.append("datasets")
    if spec["model"]["lora"]:
        names.append("peft")
    return names


def _import_model_code(spec) -> None:
    """The transformers module of the model's class for the job's task (what `from_config` or
    `from_pretrained` imports), found from the architecture or a local directory's config.json."""
    model_type = model_table.model_type(spec, _local_config(spec["model"]["name_or_path"]))
    if not model_type or model_type == "mlp":
        return
    import transformers

    from jobspec import tasks

    auto_class = getattr(transformers, tasks.get(spec["model"]["task"]).auto_class)
    auto_class._model_mapping[transformers.CONFIG_MAPPING[model_type]]


def _local_config(name_or_path: str | None) -> dict | None:
    """The config.json of a local model directory (resolved.yaml holds its absolute path)."""
    import json

    config = Path(name_or_path or "") / "config.json"
    if not name_or_path or not config.is_file():
        return None
    return json.loads(config.read_text(encoding="utf-8"))
