"""What an MLflow run and its experiment are called and marked as.

A run's name says what sets it apart: `logging.mlflow.run_name` when the spec gives one; else the
job name and the `--set` overrides that change what trains (`sentiment lr=1e-4 zero_stage=3`);
else, when the experiment holds an earlier run of the same job, the job name and the fields whose
values differ from that run's logged params; else the job name. Fields that only say where things
go or how they are shown (output and checkpoint directories, logging) are left out: two runs that
differ only there trained the same way.

The experiment is marked `mlflow.experimentKind: custom_model_development`, which MLflow 3's UI
reads to open it as model training (runs, metrics, system metrics) instead of guessing a GenAI
experiment and showing its "Evaluation runs". An experiment that already says what it is keeps it.
MLflow 3.17's UI puts a global GenAI / Model training switch above that (the URL's `workflowType`,
else the browser's last choice, GenAI by default): the run link jobspec prints carries
`?workflowType=machine_learning` (launch/console.mlflow_open; checked in a browser).
"""
from __future__ import annotations

from jobspec.spec.types import JobSpec

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"   # the value MLflow 3's UI shows as "Machine learning"

MAX_RUN_NAME_CHARS = 120   # readable in the UI's run list (MLflow itself stores up to 250)
MAX_VALUE_CHARS = 24
MAX_DIFFERENCES = 3
# where output goes, how it is shown, what it is called: not what makes one run unlike another
IGNORED = ("name", "description", "extends", "output_dir", "checkpoint.dir", "checkpoint.resume",
           "export.dir", "logging", "resources.master_port")


def ignored(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in IGNORED)


def short_value(value: str) -> str:
    """A value as a run name shows it: a path by its last part, anything long cut short."""
    text = value.strip()
    if len(text) > 1 and text[0] == text[-1] == '"':
        text = text[1:-1]
    if "/" in text and len(text) > MAX_VALUE_CHARS:
        text = text.rstrip("/").rsplit("/", 1)[-1]
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 1] + "…"


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its last part, or as many last parts as tell it from the others."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(other != key and (other == tail or other.endswith("." + tail))
                       for other in keys):
                break
        out[key] = tail
    return out


def describe(pairs: list[tuple[str, str]]) -> str:
    """`key=value` words for (dotted key, value) pairs, the list cut to MAX_DIFFERENCES."""
    shown = short_keys([key for key, _ in pairs])
    words = [f"{shown[key]}={short_value(value)}" for key, value in pairs[:MAX_DIFFERENCES]]
    if len(pairs) > MAX_DIFFERENCES:
        words.append(f"+{len(pairs) - MAX_DIFFERENCES} more")
    return " ".join(words)


def override_pairs(overrides) -> list[tuple[str, str]]:
    pairs = []
    for item in overrides or ():
        key, sep, value = str(item).partition("=")
        if sep and not ignored(key.strip()):
            pairs.append((key.strip(), value))
    return pairs


def differing_pairs(params: dict[str, str], previous: dict[str, str]) -> list[tuple[str, str]]:
    """The spec's fields whose logged value differs from (or is absent in) an earlier run's
    params."""
    return [(key, value) for key, value in sorted(params.items())
            if not ignored(key) and key in previous and previous[key] != value]


def run_name(spec: JobSpec, overrides=(), params: dict[str, str] | None = None,
             previous: dict[str, str] | None = None) -> str:
    """The run's name (module docstring). `params`: the flattened spec as it will be logged;
    `previous`: the params of the experiment's earlier run of this job, if any."""
    explicit = spec["logging"]["mlflow"]["run_name"]
    if explicit:
        return explicit
    pairs = override_pairs(overrides)
    if not pairs and params is not None and previous:
        pairs = differing_pairs(params, previous)
    name = f"{spec['name']} {describe(pairs)}" if pairs else spec["name"]
    return name if len(name) <= MAX_RUN_NAME_CHARS else name[:MAX_RUN_NAME_CHARS - 1] + "…"


def new_run_name(client, experiment_id: str, spec: JobSpec, overrides,
                 params: dict[str, str]) -> str:
    """`run_name`, asking the store for the job's previous run only when nothing else names this
    one."""
    previous = None
    if not spec["logging"]["mlflow"]["run_name"] and not override_pairs(overrides):
        previous = previous_params(client, experiment_id, spec["name"])
    return run_name(spec, overrides, params, previous)


def previous_params(client, experiment_id: str, job: str) -> dict[str, str] | None:
    """The params of the newest run of `job` in the experiment (one query); None when there is
    none."""
    if "'" in job:
        return None
    try:
        runs = client.search_runs([experiment_id], f"tags.`jobspec.job` = '{job}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
    except Exception:  # noqa: BLE001 -- a name is a nicety: the job name alone will do
        return None
    return dict(runs[0].data.params) if runs else None


def experiment_id_for(client, name: str) -> str:
    """The experiment's id, created if need be, marked as model training (module docstring)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id

