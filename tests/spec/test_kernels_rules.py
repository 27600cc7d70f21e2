"""`model.kernels: liger`'s rules (jobspec/techniques/fused_kernels.py): a model type Liger's kernels are
not mapped for, a host without a CUDA GPU, liger-kernel not installed and a tiled loss beside the
fused one are each refused at the field to change (file:line:col, exit 2), with the supported list
or the fix;
the fit search and the plan's advice never propose the refused tiled loss."""
from __future__ import annotations

import importlib.util
import json

import pytest
import yaml
from spec_builder import validate_errors

from jobspec.cli import main
from jobspec.techniques import fused_kernels as rules

TINY_LLAMA = {"architecture": "llama", "task": "causal-lm", "kernels": "liger",
              "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
                         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}}


def write(tmp_path, model=None, memory=None) -> str:
    raw = {"model": model or TINY_LLAMA, "data": {"synthetic": {"num_samples": 16, "seq_len": 32}},
           "training": {"max_steps": 2, "micro_batch_size": 1}, "memory": memory or {}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def errors(capsys, job: str, *overrides: str) -> dict[str, list[dict]]:
    """{dotted path: the problems there} of what validate reports (exit 2), {} when it accepts."""
    return validate_errors(capsys, job, *overrides)


def codes(found: dict) -> dict[str, list[str]]:
    return {path: [e["code"] for e in problems] for path, problems in found.items()}


@pytest.fixture
def gpu_host(monkeypatch):
    """A host with an NVIDIA GPU and liger-kernel and Triton installed, as NVML and the import
    system answer; the test hook off."""
    from jobspec import hardware

    monkeypatch.delenv(rules.REFERENCE_ENV, raising=False)
    monkeypatch.setattr(hardware, "gpu_count", lambda: 1)
    found = importlib.util.find_spec
    installed: dict[str, bool] = {"liger_kernel": True, "triton": True}

    def find_spec(name, *args):
        if name in installed:
            return object() if installed[name] else None
        return found(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return installed


def test_a_supported_model_on_a_gpu_host_with_the_package_is_accepted(tmp_path, capsys, gpu_host):
    job = write(tmp_path)
    assert errors(capsys, job) == {}
    for family in rules.LIGER_FAMILIES:
        assert errors(capsys, job, f"model.architecture={family}") == {}, family
    # other tasks take the layers' kernels (no fused loss: their head's loss is not a causal LM's)
    assert errors(capsys, job, "model.task=sequence-classification") == {}


def test_an_unsupported_model_type_is_refused_at_the_field_with_the_supported_list(tmp_path, capsys,
                                                                                   gpu_host):
    model = {"architecture": "bert", "task": "causal-lm", "kernels": "liger",
             "config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}}
    job = write(tmp_path, model=model)
    found = errors(capsys, job)
    assert codes(found) == {"model.kernels": ["kernels-model"]}
    problem = found["model.kernels"][0]
    assert "'bert'" in problem["message"] and "llama, mistral, phi3, qwen2" in problem["message"]
    # at the written field: line 4 of the YAML (model:, architecture:, task:, kernels:)
    assert (problem["line"], problem["column"]) == (4, 12)
    assert "model.kernels: none" in problem["hint"]


def test_a_local_checkpoints_model_type_is_read_from_its_config(tmp_path, capsys, gpu_host):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    job = write(tmp_path, model={"name_or_path": "ckpt", "task": "causal-lm", "kernels": "liger"})
    assert codes(errors(capsys, job)).get("model.kernels") == ["kernels-model"]
    qwen2 = {"model_type": "qwen2", "num_hidden_layers": 2}
    (checkpoint / "config.json").write_text(json.dumps(qwen2))
    assert "model.kernels" not in errors(capsys, job)


def test_a_host_without_a_cuda_gpu_is_refused(tmp_path, capsys, gpu_host, monkeypatch):
    from jobspec import hardware

    monkeypatch.setattr(hardware, "gpu_count", lambda: 0)
    job = write(tmp_path)
    found = errors(capsys, job)
    assert codes(found) == {"model.kernels": ["kernels-gpu"]}
    assert "CUDA" in found["model.kernels"][0]["message"]
    # the message's position in the text output: file:line:col
    assert main(["validate", job]) == 2
    err = capsys.readouterr().err
    assert f"{job}:4:12: model.kernels: Liger's kernels are Triton programs" in err
    # the test hook runs the PyTorch references: a CPU host accepts the job
    monkeypatch.setenv(rules.REFERENCE_ENV, "1")
    assert errors(capsys, job) == {}


def test_sbatch_checks_the_gpus_of_the_nodes_it_asks_for(tmp_path, capsys, gpu_host, monkeypatch):
    """A login node without GPUs writes the script of a liger job for GPU nodes; with --cpu-ranks
    the nodes have none, which is refused at the field whatever the login node has."""
    from jobspec import hardware

    job = write(tmp_path)
    monkeypatch.setattr(hardware, "gpu_count", lambda: 0)
    assert main(["sbatch", job, "--out", str(tmp_path / "job.sbatch")]) == 0
    assert f"launch.sh {job}" in (tmp_path / "job.sbatch").read_text()
    assert main(["validate", job]) == 2   # run here, the same job is refused
    capsys.readouterr()
    monkeypatch.setattr(hardware, "gpu_count", lambda: 8)
    assert main(["sbatch", job, "--cpu-ranks", "--out", str(tmp_path / "cpu.sbatch")]) == 2
    err = capsys.readouterr().err
    assert f"{job}:4:12: model.kernels: Liger's kernels are Triton programs for CUDA GPUs, and " \
        "the job's nodes have none" in err


@pytest.mark.parametrize("missing", ["liger_kernel", "triton"])
def test_a_missing_package_names_the_extra(tmp_path, capsys, gpu_host, missing):
    gpu_host[missing] = False
    found = errors(capsys, write(tmp_path))
    assert codes(found) == {"model.kernels": ["kernels-package"]}
    assert missing in found["model.kernels"][0]["message"]
    assert "pip install 'jobspec[gpu]'" in found["model.kernels"][0]["hint"]


def test_the_fused_loss_and_the_tiled_loss_are_exclusive(tmp_path, capsys, gpu_host):
    job = write(tmp_path, memory={"tiled_loss": True})
    found = errors(capsys, job)
    assert codes(found) == {"memory.tiled_loss": ["kernels-tiled-loss"]}
    assert errors(capsys, job, "model.kernels=none") == {}
    # without a causal LM's loss to fuse, the tiled loss is refused by its own rule only
    assert codes(errors(capsys, job, "model.task=sequence-classification")) == {
        "memory.tiled_loss": ["tiled-loss-task"]}


def test_the_fit_search_and_the_advice_leave_the_tiled_loss_out():
    from jobspec.memory.fit import TECHNIQUES, technique_levels
    from jobspec.memory.remedies import REMEDIES
    from jobspec.spec.schema import fill_defaults

    def spec(kernels):
        model = {**TINY_LLAMA, "kernels": kernels}
        return fill_defaults({"model": model, "training": {}, "data": {}, "memory": {}})

    plain, fused = technique_levels(spec("none")), technique_levels(spec("liger"))
    assert plain == [TECHNIQUES[:n] for n in range(len(TECHNIQUES) + 1)]
    assert fused == [(), ("memory.tiled_mlp",), ("memory.tiled_mlp", "offload")]
    tiled = next(r for r in REMEDIES["logits_and_loss"] if "tiled_loss" in r.text)

    class Plan:
        settings = {"zero_stage": 0}

    assert tiled.applies(spec("none"), Plan()) and not tiled.applies(spec("liger"), Plan())
