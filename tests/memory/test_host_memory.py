"""Host RAM per rank and per node (memory/host.py): construction by ZeRO stage, CPU offload buffers, data
loader workers, a node's ranks against `resources.host_mem`; `--fit` and `memory.fit: auto` weigh the
host; a node that cannot hold the job is exit 2 at `resources.host_mem`, saying what to change."""
from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import PROFILER, REPO_ROOT as REPO
from jobspec.cli import main
from jobspec.errors import SpecError
from jobspec.job.prepare import Host, prepare_job
from jobspec.launch import console
from jobspec.launch.host import Host as FoundHost
from jobspec.memory.fit import fit
from jobspec.memory.host import DATALOADER_WORKER_BYTES, RUNTIME_BYTES
from jobspec.memory.planner import parse_bytes, plan_memory
from jobspec.spec.derived import derive
from jobspec.spec.validation import load_and_validate
from jobspec.units import GiB, MiB

LLAMA_70B = REPO / "jobs" / "llama-70b-zero3.yaml"
GPT2_XL = REPO / "jobs" / "gpt2-xl-12gb.yaml"
BERT_LARGE = REPO / "jobs" / "bert-large-base.yaml"


def planned(job, overrides=(), **budgets):
    spec = load_and_validate(job, overrides=list(overrides)).spec
    derived = derive(spec, profiler=PROFILER)
    return spec, derived, plan_memory(spec, derived, **budgets)


def largest_module(inventory) -> int:
    return max(inventory.layer_params, max(math.prod(shape) for _, shape, _ in inventory.tensors))


@pytest.mark.parametrize("precision,lp", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_0_to_2_build_the_full_model_in_the_training_dtype(stage, precision, lp):
    spec, derived, plan = planned(BERT_LARGE, [f"memory.zero_stage={stage}", f"memory.precision={precision}",
                                               "resources.gpus_per_node=4"])
    psi = derived.profile.inventory.total
    assert plan.host["construction"] == lp * psi   # every rank, whatever the world size
    workers = spec["data"]["num_workers"] * DATALOADER_WORKER_BYTES
    assert plan.host_total == RUNTIME_BYTES + max(lp * psi, workers)
    assert plan.host_per_node == 4 * plan.host_total


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_zero3_builds_its_partition_and_the_largest_module(ranks):
    _, derived, plan = planned(BERT_LARGE, ["memory.zero_stage=3", "memory.precision=bf16",
                                            f"resources.gpus_per_node={ranks}"])
    inventory = derived.profile.inventory
    assert plan.host["construction"] == 2 * (math.ceil(inventory.total / ranks) + largest_module(inventory))
    assert plan.host_per_node == ranks * plan.host_total
    # bert-large's largest module is its 30522 x 1024 word embedding (31M), larger than a layer (12.6M)
    assert largest_module(inventory) == max(inventory.layer_params, 30522 * 1024)


@pytest.mark.parametrize("stage,ranks", [(1, 2), (2, 4), (2, 8), (3, 2), (3, 8)])
def test_cpu_offload_buffers_are_held_while_training(stage, ranks):
    """Optimizer offload: fp32 master + Adam states + the fp32 gradient partition (+ stage 1/2's 16-bit
    transfer buffer) per rank; the peak is the larger of construction and training."""
    _, derived, plan = planned(BERT_LARGE, [f"memory.zero_stage={stage}", "memory.precision=bf16",
                                            "memory.offload.optimizer=cpu", f"resources.gpus_per_node={ranks}"])
    psi = derived.profile.inventory.total
    part = math.ceil(psi / ranks)
    adam = math.ceil(8 * psi / ranks)   # the optimizer's states of all parameters, partitioned
    assert plan.host["offloaded_optimizer"] == 4 * part + adam + 4 * part + (2 * part if stage < 3 else 0)
    training = plan.host["offloaded_optimizer"] + plan.host["dataloader_workers"]
    assert plan.host_total == RUNTIME_BYTES + max(plan.host["construction"], training)
    assert plan.host_per_node == ranks * plan.host_total


def test_zero3_parameter_offload_keeps_the_partition_on_the_host():
    _, derived, plan = planned(BERT_LARGE, ["memory.zero_stage=3", "memory.precision=bf16", "memory.offload.optimizer=cpu",
                                            "memory.offload.params=cpu", "resources.gpus_per_node=2"])
    assert plan.host["offloaded_parameters"] == 2 * math.ceil(derived.profile.inventory.total / 2)


def test_data_loader_workers_are_counted_per_rank():
    _, _, none = planned(BERT_LARGE, ["data.num_workers=0"])
    _, _, four = planned(BERT_LARGE, ["data.num_workers=4", "memory.offload.optimizer=cpu", "memory.zero_stage=2"])
    assert none.host["dataloader_workers"] == 0 and four.host["dataloader_workers"] == 4 * DATALOADER_WORKER_BYTES


def test_fits_means_gpu_and_host_both_fit():
    _, _, plan = planned(GPT2_XL, budget=parse_bytes("12GiB"), host_budget=parse_bytes("16GiB"))
    assert plan.gpu_fits is True and plan.host_fits is False and plan.fits is False
    _, _, roomy = planned(GPT2_XL, budget=parse_bytes("12GiB"), host_budget=parse_bytes("64GiB"))
    assert roomy.fits is True
    _, _, unknown = planned(GPT2_XL, budget=parse_bytes("12GiB"))
    assert unknown.host_fits is None and unknown.fits is True   # an unknown host does not fail a plan


def test_shipped_70b_job_fits_the_gpu_and_its_node():
    spec, _, plan = planned(LLAMA_70B, budget=parse_bytes("80GiB"),
                            host_budget=parse_bytes(load_and_validate(LLAMA_70B).spec["resources"]["host_mem"]))
    assert plan.settings["parameters"] > 70e9 and plan.ranks_per_node == 8
    assert plan.gpu_fits and plan.host_fits
    # the issue's plan said 262.83 GiB per rank (the model in fp32 on every rank): now the partition
    assert plan.host_total < 4 * GiB and plan.host["construction"] < 3 * GiB


def test_70b_at_zero2_does_not_fit_a_1tib_node_and_plan_names_zero3(capsys):
    code = main(["plan", str(LLAMA_70B), "--set", "memory.zero_stage=2"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "host: does NOT fit in 1024.00 GiB per node" in out
    line = next(line for line in err.splitlines() if "resources.host_mem:" in line)
    assert line.startswith(f"{LLAMA_70B}:")   # positioned at the field in the file
    host_mem_line = LLAMA_70B.read_text().splitlines().index(
        next(text for text in LLAMA_70B.read_text().splitlines() if text.strip().startswith("host_mem:")))
    assert f":{host_mem_line + 1}:" in line
    assert "8 ranks x 132.42 GiB" in line and "--set memory.zero_stage=3" in line
    assert "Traceback" not in err


def test_plan_json_refuses_a_host_that_cannot_fit(capsys):
    code = main(["plan", str(GPT2_XL), "--host-mem", "16GiB", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""   # one object, the error
    issue = json.loads(err)["errors"][0]
    assert issue["dotted_path"] == "resources.host_mem"
    assert "memory.offload.optimizer=none" in json.dumps(issue)


def test_fit_weighs_the_host_and_says_when_offload_would_overflow_it():
    spec = load_and_validate(GPT2_XL).spec
    derived = derive(spec, profiler=PROFILER)
    free = fit(spec, derived, parse_bytes("12GiB"))
    host = parse_bytes("25GiB")
    assert free.plan.host_per_node > host   # the fastest GPU fit keeps the CPU optimizer offload
    bounded = fit(spec, derived, parse_bytes("12GiB"), host_budget=host)
    assert bounded.fits and bounded.plan.host_per_node <= host and bounded.changes != free.changes
    assert bounded.slowdown >= free.slowdown
    assert any("fits the GPU" in note and "more than 25.00 GiB" in note for note in bounded.notes)
    nothing = fit(spec, derived, parse_bytes("12GiB"), host_budget=parse_bytes("16GiB"))
    assert not nothing.fits and nothing.host_limited and "host RAM per node" in nothing.reason


def test_plan_fit_exit_2_when_only_the_host_stops_it(capsys):
    code = main(["plan", str(GPT2_XL), "--fit", "--gpu-mem", "12GiB", "--host-mem", "16GiB"])
    _, err = capsys.readouterr()
    assert code == 2 and "resources.host_mem: nothing fits both" in err


def write_job(tmp_path, **sections):
    spec = {"name": "host", "model": {"architecture": "bert", "config": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256,
        "vocab_size": 512, "max_position_embeddings": 512}},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 64}, "num_workers": 0},
        "training": {"max_steps": 4, "micro_batch_size": 8}, "resources": {"gpus_per_node": 2},
        "output_dir": "out", "logging": {"mlflow": {"enabled": False}}}
    for name, values in sections.items():
        spec[name] = {**spec.get(name, {}), **values}
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_fit_auto_refuses_a_node_that_cannot_hold_the_job(tmp_path):
    job = write_job(tmp_path, memory={"fit": "auto"}, resources={"host_mem": "600MiB"})
    with pytest.raises(SpecError) as raised:
        prepare_job(job, host=Host(gpu_free=parse_bytes("80GiB")), plan=True, compile=False)
    issue = raised.value.issues[0]
    assert issue.dotted_path == "resources.host_mem" and issue.line is not None
    # a CPU host (no GPU budget: the fit is skipped) is refused too
    with pytest.raises(SpecError):
        prepare_job(job, host=Host(), plan=True, compile=False)


def test_as_written_the_header_warns(tmp_path):
    job = write_job(tmp_path, resources={"host_mem": "600MiB"})
    prepared = prepare_job(job, host=Host(), plan=True, compile=False)
    memory = prepared.memory
    assert memory.plan.host_fits is False and memory.host_problem is not None
    found = FoundHost(cpus=2, ram_total=16 * GiB, ram_available=12 * GiB)
    lines = console.header_lines(prepared.spec, prepared.derived, memory, found, [])
    host_line = next(line for line in lines if line.strip().startswith("host RAM"))
    assert "per node (2 ranks)" in host_line and "600.0 MiB (resources.host_mem): DOES NOT FIT" in host_line
    assert any(line.startswith("WARNING: the nodes cannot hold this job") for line in lines)


def test_the_launching_hosts_ram_is_the_budget_of_a_one_node_job_only(tmp_path):
    one = prepare_job(write_job(tmp_path), host=Host(ram_total=64 * GiB), plan=True, compile=False).memory
    assert one.host_budget == 64 * GiB and one.host_budget_source == "this host's RAM" and one.plan.host_fits
    two = prepare_job(write_job(tmp_path, resources={"nodes": 2}), host=Host(ram_total=64 * GiB), plan=True,
                      compile=False).memory
    assert two.host_budget is None and two.plan.host_fits is None
    assert one.plan.host_total >= RUNTIME_BYTES and one.plan.host_total < RUNTIME_BYTES + 64 * MiB


def test_launch_dry_run_warns_as_written_and_refuses_under_fit_auto(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    job = write_job(tmp_path, resources={"host_mem": "600MiB"})
    assert main(["launch", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "WARNING: the nodes cannot hold this job" in out
    job = write_job(tmp_path, resources={"host_mem": "600MiB"}, memory={"fit": "auto"})
    assert main(["launch", str(job), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{job}:" in err and "resources.host_mem: the plan needs" in err and "Traceback" not in err
