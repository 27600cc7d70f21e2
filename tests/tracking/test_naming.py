"""MLflow run names that say what differs (`--set` overrides, else the fields that changed since the
job's previous run), and the experiment marked as model training for MLflow 3's UI."""
from __future__ import annotations

import json

import yaml
from spec_builder import build_spec

from jobspec.spec.schema import fill_defaults
from jobspec.tracking import naming
from jobspec.tracking import run as tracking

LAUNCH = {"argv": ["deepspeed"], "world_size": 2, "nodes": 1, "gpus_per_node": 2, "master_port": 29500}


def spec_of(tmp_path, uri: str, name: str = "sentiment", **changes) -> dict:
    sections: dict = {}
    for key, value in changes.items():
        section, field = key.split("__")
        sections.setdefault(section, {})[field] = value
    return build_spec(base={"name": name, "model": {"architecture": "bert"}, "data": {"synthetic": {}},
                            "training": {"max_steps": 3}, "output_dir": str(tmp_path / "out"),
                            "logging": {"mlflow": {"tracking_uri": uri, "experiment": "names"}}}, **sections)


def start(tmp_path, spec: dict, overrides=(), n: int = 0):
    run_dir = tmp_path / f"run{n}"
    run_dir.mkdir()
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec))
    (run_dir / "spec.yaml").write_text(f"name: {spec['name']}\n")
    (run_dir / "ds_config.json").write_text(json.dumps({}))
    tracked = tracking.start_run(spec, {**LAUNCH, "overrides": list(overrides)}, {}, f"name: {spec['name']}\n",
                                 run_dir)
    return tracked.client.get_run(tracked.run_id), tracked


def test_names_from_overrides_are_short_and_leave_out_where_things_go():
    spec = fill_defaults({"name": "sentiment", "model": {"architecture": "bert"}, "data": {"synthetic": {}}})
    assert naming.run_name(spec, ["training.optimizer.lr=1e-4"]) == "sentiment lr=1e-4"
    assert naming.run_name(spec, ["output_dir=/x", "logging.mlflow.tracking_uri=sqlite:///a.db",
                                  "logging.every_n_steps=2"]) == "sentiment"
    # a leaf shared by two keys keeps as much of the path as tells them apart; long paths by their end
    name = naming.run_name(spec, ["model.config.hidden_size=64", "data.synthetic.hidden_size=3",
                                  "data.train=/very/long/path/to/the/data/train-2026.jsonl", "memory.zero_stage=3"])
    assert name == "sentiment config.hidden_size=64 synthetic.hidden_size=3 train=train-2026.jsonl +1 more"
    long = naming.run_name(spec, [f"model.config.k{i}={'v' * 40}" for i in range(3)])
    assert len(long) <= naming.MAX_RUN_NAME_CHARS
    spec["logging"]["mlflow"]["run_name"] = "mine"
    assert naming.run_name(spec, ["training.optimizer.lr=1e-4"]) == "mine"   # an explicit name wins


def test_runs_are_named_by_overrides_else_by_what_changed_since_the_jobs_last_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first, tracked = start(tmp_path, spec_of(tmp_path, uri))
    assert first.info.run_name == "sentiment"   # nothing to compare with
    experiment = tracked.client.get_experiment(first.info.experiment_id)
    assert experiment.tags[naming.EXPERIMENT_KIND_TAG] == "custom_model_development"
    with_set, _ = start(tmp_path, spec_of(tmp_path, uri, memory__zero_stage=2),
                        ["memory.zero_stage=2", f"output_dir={tmp_path}"], n=1)
    assert with_set.info.run_name == "sentiment zero_stage=2"
    # no --set: the fields whose values differ from the job's previous run (the zero_stage=2 one)
    changed, _ = start(tmp_path, spec_of(tmp_path, uri, memory__zero_stage=2, training__max_steps=5), n=2)
    assert changed.info.run_name == "sentiment max_steps=5"
    same, _ = start(tmp_path, spec_of(tmp_path, uri, memory__zero_stage=2, training__max_steps=5), n=3)
    assert same.info.run_name == "sentiment"
    other_job, _ = start(tmp_path, spec_of(tmp_path, uri, name="other", training__max_steps=9), n=4)
    assert other_job.info.run_name == "other"   # another job's runs are not its previous run


def test_an_existing_experiment_is_marked_once_and_keeps_its_own_kind(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.client_for(uri)
    unmarked = client.create_experiment("names")
    start(tmp_path, spec_of(tmp_path, uri))
    assert client.get_experiment(unmarked).tags[naming.EXPERIMENT_KIND_TAG] == "custom_model_development"
    genai = client.create_experiment("agents", tags={naming.EXPERIMENT_KIND_TAG: "genai_development"})
    assert naming.experiment_id_for(client, "agents") == genai
    assert client.get_experiment(genai).tags[naming.EXPERIMENT_KIND_TAG] == "genai_development"
