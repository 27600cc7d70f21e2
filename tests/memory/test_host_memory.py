"""Host RAM per rank and per node (memory/host_ram.py): construction by ZeRO stage, CPU offload buffers, data
loader workers, a node's ranks against `resources.host_mem`; `--fit` and `memory.fit: auto` weigh the
host; a node that cannot hold the job is exit 2 at `resources.host_mem`, saying what to change."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import spec_builder
from conftest import PROFILER, free_port
from conftest import REPO_ROOT as REPO

from jobspec.cli import main
from jobspec.errors import SpecError
from jobspec.hardware import Host
from jobspec.job.prepare import PLANNED, prepare_job
from jobspec.launch import console
from jobspec.memory.fit import fit
from jobspec.memory.host_ram import DATALOADER_WORKER_BYTES, RUNTIME_BYTES, offload_terms, stage3_sub_groups
from jobspec.memory.planner import parse_bytes, plan_memory
from jobspec.spec.derived import derive
from jobspec.spec.validation import load_and_validate
from jobspec.units import GiB, MiB

LLAMA_70B = REPO / "jobs" / "llama-70b-zero3.yaml"
GPT2_XL = REPO / "jobs" / "gpt2-xl-12gb.yaml"
BERT_LARGE = REPO / "jobs" / "bert-large-base.yaml"
LLAMA_8B_QLORA = REPO / "jobs" / "llama-8b-qlora-24gb.yaml"


def planned(job, overrides=(), **budgets):
    spec = load_and_validate(job, overrides=list(overrides)).spec
    derived = derive(spec, profiler=PROFILER)
    return spec, derived, plan_memory(spec, derived, **budgets)


def largest_module(inventory) -> int:
    return max(inventory.layer_params, max(math.prod(shape) for _, shape, _ in inventory.tensors))


@pytest.mark.parametrize("precision,lp", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_0_to_2_cpu_ranks_build_the_full_model_in_the_training_dtype(stage, precision, lp):
    spec, derived, plan = planned(BERT_LARGE, [f"memory.zero_stage={stage}", f"memory.precision={precision}",
                                               "resources.gpus_per_node=4"], cpu_ranks=True)
    psi = derived.profile.inventory.total
    assert plan.host["construction"] == lp * psi   # every rank, whatever the world size
    training = sum(v for k, v in plan.host.items() if k not in ("runtime", "construction"))
    assert plan.host_total == RUNTIME_BYTES + max(lp * psi, training)
    assert plan.host_per_node == 4 * plan.host_total


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_0_to_2_gpu_ranks_build_on_the_gpu_and_load_a_checkpoint_a_tensor_at_a_time(stage):
    """A GPU rank outside ZeRO-3 creates and draws its model on the GPU: nothing of it on the host;
    a checkpoint passes through the host one tensor at a time (the largest one in flight)."""
    spec, derived, plan = planned(BERT_LARGE, [f"memory.zero_stage={stage}", "memory.precision=bf16",
                                               "resources.gpus_per_node=4"])
    assert plan.host["construction"] == 0
    workers = spec["data"]["num_workers"] * DATALOADER_WORKER_BYTES
    assert plan.host_total == RUNTIME_BYTES + max(0, workers + plan.host.get("data_index", 0))
    from jobspec.memory.host_ram import construction_bytes
    inventory = derived.profile.inventory
    largest = max(math.prod(shape) for _, shape, _ in inventory.tensors)
    assert construction_bytes(inventory, stage, 4, 2, gpu_ranks=True, pretrained=True) == 2 * largest
    assert construction_bytes(inventory, stage, 4, 2, gpu_ranks=False, pretrained=True) == 2 * inventory.total


def test_a_quantised_base_on_cpu_ranks_holds_its_packed_weights_and_one_layer_being_quantised():
    """QLoRA's base is quantised layer by layer as it is made (model/materialize): its packed weights
    (planner.weight_bytes) and bitsandbytes' CPU quantisation of the largest layer, never the 16-bit
    model; on a GPU rank nothing of it on the host."""
    from jobspec.memory.host_ram import QUANTIZE_CPU_BYTES_PER_ELEMENT
    from jobspec.memory.planner import weight_bytes

    qlora = ["resources.gpus_per_node=1"]
    spec, derived, plan = planned(LLAMA_8B_QLORA, qlora, cpu_ranks=True)
    inventory = derived.profile.inventory
    assert inventory.quantized
    weights = weight_bytes(inventory, 2, spec["model"]["quantization"])
    largest = max(math.prod(shape) for shape in inventory.quantized_shapes())
    assert plan.host["construction"] == weights + QUANTIZE_CPU_BYTES_PER_ELEMENT * largest
    assert plan.host["construction"] < 2 * inventory.total   # below the model in 16 bits
    _, _, on_gpu = planned(LLAMA_8B_QLORA, qlora)
    assert on_gpu.host["construction"] == 0


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
    # ZeRO-3's 16-bit gradient partition beside the fp32 one; ZeRO-1/2's transfer buffer of the largest
    # parameter (memory/host_ram.offload_terms)
    if stage == 3:
        assert plan.host["offload_gradient_accumulation"] == 2 * part
    else:
        largest = max(math.prod(shape) for _, shape, _ in derived.profile.inventory.tensors)
        assert plan.host["offload_temp_gradient"] == 2 * largest
    assert plan.host["pinned_rounding"] > 0   # offload.pin_memory defaults to true
    training = sum(v for k, v in plan.host.items() if k not in ("runtime", "construction"))
    assert plan.host_total == RUNTIME_BYTES + max(plan.host["construction"], training)
    assert plan.host_per_node == ranks * plan.host_total


def test_pinned_buffers_round_up_to_a_power_of_two():
    """torch's CachingHostAllocator rounds each pinned block up to a power of two: a ZeRO-3 rank of a
    4.54B-parameter bf16 model (the H100 run in docs/benchmarks.md) pins its 8.46 GiB 16-bit gradient
    partition as 16 GiB and each ~1e9-element sub-group's fp32 gradient as 4 GiB."""
    part = 4_540_000_000
    unpinned = offload_terms(stage=3, world=1, lp=2, trainable=part, opt_states=8 * part, largest_param=0,
                             sub_group_size=10**9, pinned=False)
    pinned = offload_terms(stage=3, world=1, lp=2, trainable=part, opt_states=8 * part, largest_param=0,
                           sub_group_size=10**9, pinned=True)
    assert sum(unpinned.values()) == 18 * part and "pinned_rounding" not in unpinned
    # 16 GiB for the bf16 partition; four 1e9-element sub-groups of 4 GiB and the 0.54e9 rest as 4 GiB
    assert pinned["pinned_rounding"] == (16 * GiB - 2 * part) + 4 * (4 * GiB - 4 * 10**9) + (4 * GiB - 4 * 540_000_000)
    assert offload_terms(stage=3, world=2, lp=2, trainable=8, opt_states=64, largest_param=4, sub_group_size=4,
                         pinned=True)["pinned_rounding"] == 0   # 16-byte groups and an 8-byte partition: exact


def test_sub_groups_follow_deepspeeds_rule():
    """memory/host_ram.stage3_sub_groups against DeepSpeed's own `_create_fp16_sub_groups`."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    class Param:
        def __init__(self, n):
            self.n = n

        def partition_numel(self):
            return self.n

    class Optimizer:
        sub_group_size = 10

    for sizes in ([3, 4, 5, 6, 1], [12, 1, 1], [2, 2], [10, 10, 3], [1] * 25):
        params = [Param(n) for n in sizes]
        theirs = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(Optimizer(), params)
        assert stage3_sub_groups(sizes, 10) == [sum(p.n for p in group) for group in theirs], sizes


@pytest.mark.slow
@pytest.mark.jit_ops("CPUAdamBuilder")   # optimizer offload's CPU Adam
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_terms_match_deepspeeds_host_tensors(stage):
    """bench/offload_host.py on one CPU rank: the host tensors DeepSpeed's ZeRO optimizer holds after a
    step, read from the optimizer, equal offload_terms' buffers (unpinned: the CPU accelerator pins
    nothing)."""
    out = subprocess.run([sys.executable, "-m", "bench.offload_host", "--stage", str(stage), "--hidden", "128",
                          "--layers", "2", "--vocab", "1000", "--steps", "1"], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "MASTER_PORT": str(free_port())})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    names = {"fp32_master": "offload_fp32_master", "fp32_gradients": "offload_fp32_gradients",
             "adam_states": "offload_optimizer_states", "gradient_accumulation": "offload_gradient_accumulation",
             "bit16_transfer": "offload_bit16_transfer", "temp_grad_buffer": "offload_temp_gradient"}
    assert {names[k]: v for k, v in result["measured"].items()} == result["planned"]
    # the terms equal (above), so bytes per parameter is arithmetic: fp32 master 4 + Adam 8 + fp32 gradients
    # 4 + the 16-bit transfer (stage 2) or accumulation (stage 3) buffer 2 = 18, plus at stage 2 the 16-bit
    # temp gradient buffer of the largest parameter, 2 x largest / psi (0.39 here); the bench rounds to 3
    # decimals: half a unit of the 3rd decimal, 5e-4, plus the division's ulps (was 18 +- 0.5 at stage 2).
    # A buffer missing or doubled moves it by >= 2 bytes per parameter
    temp_gradient = 2 * result["largest_parameter"] / result["parameters"]
    expected = 18.0 if stage == 3 else pytest.approx(18.0 + temp_gradient, abs=5e-4 + 1e-12)
    assert result["measured_bytes_per_param"] == expected


def test_zero3_parameter_offload_keeps_the_partition_on_the_host():
    _, derived, plan = planned(BERT_LARGE, ["memory.zero_stage=3", "memory.precision=bf16",
                                            "memory.offload.optimizer=cpu", "memory.offload.params=cpu",
                                            "resources.gpus_per_node=2"])
    assert plan.host["offloaded_parameters"] == 2 * math.ceil(derived.profile.inventory.total / 2)
    # DeepSpeed pins the flat parameter partition even without offload.pin_memory
    _, _, unpinned = planned(BERT_LARGE, ["memory.zero_stage=3", "memory.precision=bf16",
                                          "memory.offload.optimizer=cpu", "memory.offload.params=cpu",
                                          "resources.gpus_per_node=2",
                                          "memory.offload.pin_memory=false"])
    part = unpinned.host["offloaded_parameters"]
    assert unpinned.host["pinned_rounding"] == (1 << (part - 1).bit_length()) - part > 0


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


def test_70b_at_zero2_is_stopped_by_its_gpus_not_by_its_host(capsys):
    """At ZeRO-2 each GPU rank builds the whole bf16 model on its GPU (model/build): the host holds
    none of it, the GPU cannot hold it (131.42 GiB of parameters): exit 1, the advice naming ZeRO-3."""
    code = main(["plan", str(LLAMA_70B), "--set", "memory.zero_stage=2"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "host: fits in 1024.00 GiB per node" in out and "does NOT fit in 80.00 GiB" in out
    assert "memory.zero_stage: 3" in out and "Traceback" not in err


def test_70b_offloaded_on_one_node_does_not_fit_a_1tib_node_and_plan_says_what_to_change(capsys):
    code = main(["plan", str(LLAMA_70B), "--set", "resources.nodes=1", "--set", "memory.offload.optimizer=cpu",
                 "--set", "memory.offload.params=cpu"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "host: does NOT fit in 1024.00 GiB per node" in out
    line = next(line for line in err.splitlines() if "resources.host_mem:" in line)
    assert line.startswith(f"{LLAMA_70B}:")   # positioned at the field in the file
    host_mem_line = LLAMA_70B.read_text().splitlines().index(
        next(text for text in LLAMA_70B.read_text().splitlines() if text.strip().startswith("host_mem:")))
    assert f":{host_mem_line + 1}:" in line
    assert "8 ranks x " in line and "--set memory.offload.optimizer=none --set memory.offload.params=none" in line
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
    # the fastest GPU fit keeps the CPU optimizer offload: 35.82 GiB with its pinned buffers; the ZeRO-3
    # fit needs 30.47 GiB (memory/host_ram.offload_terms)
    host = parse_bytes("32GiB")
    assert free.plan.host_per_node > host
    bounded = fit(spec, derived, parse_bytes("12GiB"), host_budget=host)
    assert bounded.fits and bounded.plan.host_per_node <= host and bounded.changes != free.changes
    assert bounded.slowdown >= free.slowdown
    assert any("fits the GPU" in note and "more than 32.00 GiB" in note for note in bounded.notes)
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
    return spec_builder.write_job(tmp_path, base=spec, filename="host.yaml")


def test_fit_auto_refuses_a_node_that_cannot_hold_the_job(tmp_path):
    job = write_job(tmp_path, memory={"fit": "auto"}, resources={"host_mem": "600MiB"})
    with pytest.raises(SpecError) as raised:
        prepare_job(job, host=Host(gpu_free=parse_bytes("80GiB")), how=PLANNED)
    issue = raised.value.issues[0]
    assert issue.dotted_path == "resources.host_mem" and issue.line is not None
    # a CPU host (no GPU budget: the fit is skipped) is refused too
    with pytest.raises(SpecError):
        prepare_job(job, host=Host(), how=PLANNED)


def test_as_written_the_header_warns(tmp_path):
    job = write_job(tmp_path, resources={"host_mem": "600MiB"})
    prepared = prepare_job(job, host=Host(), how=PLANNED)
    memory = prepared.memory
    assert memory.plan.host_fits is False and memory.host_problem is not None
    found = Host(cpus=2, ram_total=16 * GiB, ram_available=12 * GiB)
    lines = console.header_lines(prepared.spec, prepared.derived, memory, found, [])
    host_line = next(line for line in lines if line.strip().startswith("host RAM"))
    assert "per node (2 ranks)" in host_line and "600.0 MiB (resources.host_mem): DOES NOT FIT" in host_line
    assert any(line.startswith("WARNING: the nodes cannot hold this job") for line in lines)


def test_the_launching_hosts_ram_is_the_budget_of_a_one_node_job_only(tmp_path):
    one = prepare_job(write_job(tmp_path), host=Host(ram_total=64 * GiB), how=PLANNED).memory
    assert one.host_budget == 64 * GiB and one.host_budget_source == "this host's RAM" and one.plan.host_fits
    two = prepare_job(write_job(tmp_path, resources={"nodes": 2}), host=Host(ram_total=64 * GiB), how=PLANNED).memory
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


def test_the_data_index_is_counted_per_sample_and_more_with_packing():
    """The records are memory-mapped (not counted); the index over them is, per counted sample."""
    from jobspec.memory.host_ram import DATA_BYTES_PER_SAMPLE, PACKING_BYTES_PER_SAMPLE

    spec = load_and_validate(REPO / "jobs" / "llama-instruct-packing.yaml", overrides=[]).spec
    plain = plan_memory(spec, derive(spec, profiler=PROFILER))
    assert "data_index" not in plain.host or plain.host["data_index"] == 0   # max_steps: no samples counted
    counted = derive(spec, profiler=PROFILER, num_train_samples=300)
    packed = plan_memory(spec, counted)
    assert packed.host["data_index"] == 300 * (DATA_BYTES_PER_SAMPLE + PACKING_BYTES_PER_SAMPLE)
    unpacked = plan_memory({**spec, "data": {**spec["data"], "packing": False}}, counted)
    assert unpacked.host["data_index"] == 300 * DATA_BYTES_PER_SAMPLE
    assert packed.host_total - unpacked.host_total in (0, 300 * PACKING_BYTES_PER_SAMPLE)
