"""The memory planner against one GPU, one command: `python -m bench gpu-calibrate`.

    python -m bench gpu-calibrate                       # every job; bench/calibration/<gpu>-<date>.json
    python -m bench gpu-calibrate --dry-run             # any machine: the plans, the job list, the time
    python -m bench gpu-calibrate --jobs NAME,NAME --out /tmp/cal.json --budget-s 120

For each job (`all_jobs()`: model types, precisions, attention kernels, checkpointing, LoRA, QLoRA, ZeRO-3,
long sequences with the tiled loss, the tiled MLP and offloaded checkpoints; the jobs of the first
calibration file, bench/calibration/h200-2026-11-28.json, first) it

1. writes the spec as a YAML file and plans it as `jobspec plan` does (job/prepare.prepare_job with
   AS_WRITTEN: the loader, the derivation with the traced profile, memory/planner.plan_memory);
2. compiles it as `jobspec launch` does (the planned job's compile, rundir.write_compiled) and runs the
   launch's worker (jobspec.train.worker) on one rank in a process of its own, with the ranks'
   environment (launch/pipeline.child_env: the allocator settings the plan models): a fresh allocator,
   so the worker's summary.json maxima (torch's max allocated and reserved, NVML's used memory) are
   this job's. DeepSpeed's launch.py, which only starts that process, is left out;
3. records the allocator's history for one optimizer step (SNAPSHOT_STEP) and breaks down what was
   live at that step's peak (bench/peak_snapshot.py): parameters, gradients, master weights and
   optimizer states by their tensors, activations by phase and by the module that allocated them,
   the largest allocations with their frames; beside the planner's breakdown.

Writes, after every job (what was measured survives a run cut short): the calibration file (the format
of bench/calibration/h200-2026-11-28.json; the jobs that finished, which tests/memory/test_calibration.py
holds the planner to) and `peaks/<same name>` beside it (every job's peak breakdown beside the plan's,
and why a job failed). Prints a markdown table. No new job starts after --budget-s seconds.
Nothing is downloaded: every model is built from its config, on synthetic tokens, MLflow off.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.peak_snapshot import TensorRanges, breakdown

if TYPE_CHECKING:   # the parent's planning imports them; the module stays light
    from jobspec.job.prepare import PreparedJob
    from jobspec.memory.planner import MemoryPlan
    from jobspec.spec.derived import DerivedJob

REPO = Path(__file__).resolve().parent.parent
CALIBRATION_DIR = REPO / "bench" / "calibration"
FIRST_CALIBRATION = CALIBRATION_DIR / "h200-2026-11-28.json"   # its jobs run first, by name
WORK = REPO / "bench" / "work" / "gpu-calibrate"
BUDGET_S = 330            # no job starts later: the last one ends within the 6 minutes of a lent GPU
STEPS = 3                 # step 1 allocates the optimizer states; step 2 is the one recorded
SNAPSHOT_STEP = 2
MAX_ENTRIES = 200_000     # allocator events kept (a ring buffer; the breakdown's `history_cut` says it overflowed)
GiB = 2**30
MiB = 2**20
# What every job gets on top of its spec: a short run that writes nothing big (no checkpoint, no
# export), a memory reading at every step, no MLflow (the GPU image has none).
RUN_SETTINGS = {"checkpoint": {"save_final": False, "every_n_steps": None, "resume": "never"},
                "export": {"final": False},
                "logging": {"every_n_steps": 1, "progress": "lines", "system_metrics": False,
                            "mlflow": {"enabled": False}}}
# The time estimate: process start (interpreter, torch/DeepSpeed/transformers imports, process group,
# engine) + building the model on the host and moving it + the steps' hardware FLOPs at a sustained rate.
START_S, BUILD_S_PER_BILLION = 12.0, 6.0
SUSTAINED_TFLOPS = {"bf16": 300.0, "fp16": 300.0, "fp32": 40.0}   # H200; fp32 without TF32 (memory.tf32 off)
VISIBLE = "CUDA_VISIBLE_DEVICES"
HOW = ("jobspec.train.worker on one rank in its own process, over the run files `jobspec launch` "
       "writes (summary.json maxima)")


@dataclass(frozen=True)
class Job:
    name: str
    spec: dict            # the complete job spec as written (RUN_SETTINGS are added when it runs)
    note: str = ""


# --- the jobs --------------------------------------------------------------------------------------

IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "tie_word_embeddings": True,
            "max_position_embeddings": 131072}
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False,
             "max_position_embeddings": 2048}
XLMR_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
             "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1}
GPT2_MEDIUM = {"n_embd": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 50257, "n_positions": 1024}
QWEN2_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
             "tie_word_embeddings": True, **IDS}
MISTRAL_05B = {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
               "intermediate_size": 5632, "vocab_size": 32768, "max_position_embeddings": 32768,
               "sliding_window": None, **IDS}
GEMMA2_05B = {"hidden_size": 1152, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 256, "intermediate_size": 6912, "vocab_size": 256000, "sliding_window": 4096,
              "query_pre_attn_scalar": 256, "max_position_embeddings": 8192, **IDS}
LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}


def model(architecture: str, config: dict, attention: str, task: str = "causal-lm", **extra) -> dict:
    section = {"architecture": architecture, "task": task, "attention": attention, "config": config, **extra}
    return {**section, "num_labels": 2} if task == "sequence-classification" else section


def job(name: str, model_section: dict, seq: int, micro: int, precision: str, memory: dict | None = None,
        note: str = "") -> Job:
    """A one-rank job on synthetic tokens (ids below the vocabulary), one micro-batch per step."""
    vocab = model_section["config"].get("vocab_size", 30522)   # BERT's when the config leaves it out
    return Job(name, {
        "name": name, "model": model_section,
        "data": {"synthetic": {"num_samples": 8 * micro, "seq_len": seq, "vocab_range": [100, vocab - 100]}},
        "training": {"max_steps": STEPS, "optimizer": {"name": "adamw", "lr": 1e-05},
                     "micro_batch_size": micro, "global_batch_size": micro},
        "memory": {"zero_stage": 0, "precision": precision, **(memory or {})},
        "resources": {"gpus_per_node": 1}, "logging": {"mlflow": {"enabled": False}}}, note)


# The longest first: a run cut by --budget-s loses the short jobs at the end, and ends soon after it.
NEW_JOBS = [
    job("llama-1b-32k-ckpt-offload-tiled-loss-mlp", model("llama", LLAMA_1B, "sdpa"), 32768, 1, "bf16",
        {"activation_checkpointing": {"every_n_layers": 1, "offload": "cpu"}, "tiled_loss": True,
         "tiled_mlp": True}),
    job("llama-1b-16k-ckpt", model("llama", LLAMA_1B, "sdpa"), 16384, 1, "bf16",
        {"activation_checkpointing": True}, "16K tokens, the loss not tiled"),
    job("llama-1b-qlora-nf4-ckpt-b4-s4096",
        model("llama", LLAMA_1B, "sdpa", lora=LORA, quantization={"bits": 4, "quant_type": "nf4",
                                                                  "double_quant": True}),
        4096, 4, "bf16", {"activation_checkpointing": True}, "QLoRA: 4-bit NF4 base, LoRA r 16 all-linear"),
    job("tinyllama-bf16-sdpa-b2-s2048-zero3", model("llama", TINYLLAMA, "sdpa"), 2048, 2, "bf16",
        {"zero_stage": 3}, "tinyllama-bf16-sdpa-b2-s2048 under ZeRO-3 on one rank"),
    job("mistral-0.5b-fp32-eager-b4-s1024", model("mistral", MISTRAL_05B, "eager"), 1024, 4, "fp32"),
    job("qwen2-0.5b-bf16-sdpa-lora-b4-s2048", model("qwen2", QWEN2_05B, "sdpa", lora=LORA), 2048, 4, "bf16",
        note="LoRA r 16 on every linear layer, frozen bf16 base"),
    job("gemma2-0.5b-bf16-eager-ckpt2-b2-s2048", model("gemma2", GEMMA2_05B, "eager"), 2048, 2, "bf16",
        {"activation_checkpointing": {"every_n_layers": 2}}, "256K vocabulary: the logits term is large"),
    job("xlmr-base-fp16-eager-ckpt-b16-s512",
        model("xlm-roberta", XLMR_BASE, "eager", task="sequence-classification"), 512, 16, "fp16",
        {"activation_checkpointing": True}, "seed 000's XLM-R base batch 16 fp16 row, checkpointed"),
    job("gpt2-medium-fp16-sdpa-b8-s1024", model("gpt2", GPT2_MEDIUM, "sdpa"), 1024, 8, "fp16"),
]


def first_calibration_jobs() -> list[Job]:
    """The jobs of the first calibration file, specs as committed: their new readings line up with its."""
    data = json.loads(FIRST_CALIBRATION.read_text(encoding="utf-8"))
    return [Job(j["name"], j["spec"], j.get("note", "")) for j in data["jobs"]]


def all_jobs() -> list[Job]:
    return first_calibration_jobs() + NEW_JOBS


def run_spec(job: Job) -> dict:
    """The spec that runs and is recorded: the job's with RUN_SETTINGS merged in."""
    from jobspec.spec.loader import deep_merge
    return deep_merge(job.spec, RUN_SETTINGS)


# --- planning (the parent) -------------------------------------------------------------------------

@dataclass
class Planned:
    job: Job
    prepared: PreparedJob
    plan: MemoryPlan
    plan_s: float         # the planning time (the traces, cached in JOBSPEC_CACHE_DIR)
    estimate_s: float     # the run's expected time on the GPU


def write_job_file(job: Job, work: Path) -> Path:
    """The spec that runs as work/NAME/job.yaml; its output directory beside it (nothing goes to ./runs)."""
    import yaml
    path = work / job.name / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({**run_spec(job), "output_dir": "out"}, sort_keys=False), encoding="utf-8")
    return path


def plan_job(job: Job, work: Path) -> Planned:
    """The job planned as `jobspec plan JOB` plans it (no budget: the spec as written, no host probed)."""
    from jobspec.hardware import Host
    from jobspec.job.prepare import AS_WRITTEN, prepare_job
    started = time.monotonic()
    prepared = prepare_job(write_job_file(job, work), (), Host(gpu_free=None, bf16_supported=True), AS_WRITTEN)
    assert prepared.memory is not None   # AS_WRITTEN plans it
    if prepared.memory.plan_error is not None:
        raise prepared.resolved.locate(prepared.memory.plan_error)
    plan = prepared.memory.plan
    assert plan is not None   # no plan_error: the planner counted the model
    return Planned(job, prepared, plan, time.monotonic() - started,
                   estimate_s(prepared.derived, job.spec["memory"]["precision"]))


def estimate_s(derived: DerivedJob, precision: str) -> float:
    """Seconds the job takes on the GPU, start to exit (START_S, BUILD_S_PER_BILLION, SUSTAINED_TFLOPS)."""
    tokens = derived.tokens_per_micro_batch * derived.gradient_accumulation_steps * STEPS
    flops = (derived.hardware_flops_per_token or 0.0) * tokens
    return START_S + BUILD_S_PER_BILLION * (derived.num_parameters or 0) / 1e9 + \
        flops / (SUSTAINED_TFLOPS[precision] * 1e12)


def compile_run(planned: Planned, run_dir: Path, rank_gpus: dict[str, str] | None = None) -> dict:
    """The run directory `jobspec launch` would write for the job, and the environment of its one rank
    (`rank_gpus`: its CUDA_VISIBLE_DEVICES, where this process hid the GPUs from itself: hide_gpus)."""
    import shutil

    from jobspec import rundir
    from jobspec.launch.pipeline import child_env
    from jobspec.launch.runner import free_port
    shutil.rmtree(run_dir, ignore_errors=True)   # an earlier calibration's run of the job
    port = free_port()
    prepared = planned.prepared
    compiled = prepared.compile(run_dir, port)
    rundir.write_compiled(run_dir, prepared.resolved, compiled)
    env = child_env(prepared.spec, compiled.plan, None)
    if rank_gpus is not None:
        env.pop(VISIBLE, None)
        env.update(rank_gpus)
    # what DeepSpeed's launch.py sets for a rank
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", CROSS_RANK="0", CROSS_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


# --- one job on the GPU (the child process) --------------------------------------------------------

def child(run_dir: Path, peak_out: Path, step: int, max_entries: int) -> int:
    """The launch's worker on the compiled run directory, one rank (the environment says which), with the
    allocator's history recorded for optimizer step `step`; its breakdown written to `peak_out`."""
    from jobspec.train import assembly, worker
    recorder = PeakRecorder(step, max_entries)
    build_engine = assembly.build_engine   # the first engine's and an OOM recovery's

    def build_and_watch(*args, **kwargs):   # DeepSpeed is imported by now, as the worker imports it
        built = build_engine(*args, **kwargs)
        recorder.install(type(built[0]))
        return built
    assembly.build_engine = build_and_watch
    code = worker.main(["--run-dir", str(run_dir)])
    result = {"exit_code": code, "optimizer_steps": recorder.done, "skipped_steps": recorder.skipped, **recorder.result}
    peak_out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return code


@dataclass
class PeakRecorder:
    """Wraps DeepSpeedEngine.step and .backward: records the allocator's history from the end of optimizer
    step `step - 1` to the end of step `step`, then breaks the peak down (bench/peak_snapshot.py)."""

    step: int
    max_entries: int
    done: int = 0
    recording: bool = False
    ranges: TensorRanges = field(default_factory=TensorRanges)
    result: dict = field(default_factory=dict)
    # optimizer steps DeepSpeed skipped so far (fp16's loss scale overflowing): a step skipped before the
    # recorded one leaves the optimizer states unmade, and the recorded peak low
    skipped: int | None = None

    def install(self, engine_class) -> None:
        if getattr(engine_class, "_calibration_recorder", None) is self:
            return   # an OOM retry builds a second engine of the same class
        engine_class._calibration_recorder = self
        step, backward, recorder = engine_class.step, engine_class.backward, self

        def recorded_step(engine, *args, **kwargs):
            boundary = engine.is_gradient_accumulation_boundary()   # before step() moves it on
            out = step(engine, *args, **kwargs)
            if boundary:
                recorder.after_step(engine)
            return out

        def recorded_backward(engine, *args, **kwargs):
            out = backward(engine, *args, **kwargs)
            if recorder.recording:   # the gradients are there now, some gone after the step
                collect_ranges(engine, recorder.ranges)
            return out
        engine_class.step, engine_class.backward = recorded_step, recorded_backward

    def after_step(self, engine) -> None:
        import torch
        self.done += 1
        self.skipped = getattr(engine, "skipped_steps", None)
        if not torch.cuda.is_available():   # CPU ranks (a smoke test): no allocator history to record
            self.result = {"error": "no CUDA device: no allocator history"}
        elif self.done == self.step - 1:
            self.ranges = TensorRanges()
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=self.max_entries)
            self.recording = True
        elif self.done == self.step and self.recording:
            self.recording = False
            try:
                self.result = self.peak(engine)
            except Exception as err:   # noqa: BLE001 - the breakdown is extra: the run goes on without it
                torch.cuda.memory._record_memory_history(enabled=None)
                self.result = {"error": f"{type(err).__name__}: {err}"}

    def peak(self, engine) -> dict:
        import torch

        from jobspec.hardware import nvml_used_bytes
        torch.cuda.synchronize()
        collect_ranges(engine, self.ranges)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        started = time.monotonic()
        out = breakdown(snapshot, self.ranges, device=torch.cuda.current_device())
        nvml = nvml_used_bytes(torch.device("cuda", torch.cuda.current_device()))
        return {"step": self.step, "max_entries": self.max_entries,
                "history_cut": out["trace_events"] >= self.max_entries,   # the ring buffer lost the step's start
                # the allocator's own peak since the worker's last reading (the previous step's end)
                "torch_max_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 3),
                "torch_reserved_gib": round(torch.cuda.memory_reserved() / GiB, 3),
                "nvml_used_gib": None if nvml is None else round(nvml / GiB, 3),
                "analysis_s": round(time.monotonic() - started, 2), **out}


def collect_ranges(engine, ranges) -> None:
    """The storages of the engine's parameters (ZeRO-3: their partitions), gradients, buffers, the
    optimizer's states and parameters (fp32 masters under mixed precision) and the tensors DeepSpeed's
    optimizer wrapper keeps (flat buffers), named by term."""
    import torch

    def add(tensor, term: str, name: str) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.untyped_storage().nbytes():
            storage = tensor.untyped_storage()
            ranges.add(storage.data_ptr(), storage.nbytes(), term, name)

    for name, p in engine.module.named_parameters():
        add(p, "parameters", name)
        add(getattr(p, "ds_tensor", None), "parameters", f"{name} (ZeRO-3 partition)")
        add(p.grad, "gradients", name)
    for name, b in engine.module.named_buffers():
        add(b, "buffers", name)
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)   # DeepSpeed's wrappers hold the torch optimizer
    if isinstance(inner, torch.optim.Optimizer):
        for state in inner.state.values():
            for key, value in state.items():
                add(value, "optimizer_states", f"{type(inner).__name__} {key}")
        for group in inner.param_groups:
            for p in group["params"]:
                add(p, "master_weights", f"{type(inner).__name__} parameter")
    if wrapper is not None and wrapper is not inner:
        for attr, value in vars(wrapper).items():
            for tensor in tensors_in(value):
                add(tensor, wrapper_term(attr), f"{type(wrapper).__name__}.{attr}")


def tensors_in(value, depth: int = 3) -> list:
    """The tensors in a value of an optimizer wrapper's attribute: a tensor, or lists/dicts of them."""
    if hasattr(value, "untyped_storage"):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v, depth - 1)]
    return []


def wrapper_term(attr: str) -> str:
    name = attr.lower()
    if "grad" in name:
        return "gradients"
    return "master_weights" if "fp32" in name or "master" in name else "optimizer wrapper buffers"


# --- running and recording (the parent) ------------------------------------------------------------

@dataclass
class Running:
    planned: Planned
    run_dir: Path
    proc: subprocess.Popen
    started: float
    port: str
    log: Path


def hide_gpus() -> dict[str, str]:
    """Hide the GPUs from this process, which plans on fake tensors and needs none: a CUDA context here
    (an import that asks torch about the device) would count in every job's NVML reading. Returns the
    variable as the ranks must have it."""
    original = os.environ.get(VISIBLE)
    os.environ[VISIBLE] = ""
    return {} if original is None else {VISIBLE: original}


def start(planned: Planned, work: Path, rank_gpus: dict[str, str]) -> Running:
    """Compile the job's run directory and start its rank (`python -m bench.gpu_calibrate --child`)."""
    run_dir = work / planned.job.name / "run"
    env = compile_run(planned, run_dir, rank_gpus)
    log = work / planned.job.name / "child.log"
    cmd = [sys.executable, "-m", "bench.gpu_calibrate", "--child", str(run_dir),
           "--peak-out", str(run_dir.parent / "peak.json")]
    with open(log, "w", encoding="utf-8") as out:   # a process group of its own: a hung job is ended whole
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Running(planned, run_dir, proc, time.monotonic(), env["MASTER_PORT"], log)


def finish(running: Running) -> dict:
    """Wait for the job (at most 4 x its estimate, 2 minutes at least); what it measured."""
    import signal

    from jobspec import rundir
    from jobspec.shm import remove_shared_memory_buffers
    limit = max(120.0, 4 * running.planned.estimate_s)
    try:
        code = running.proc.wait(timeout=max(1.0, limit - (time.monotonic() - running.started)))
    except subprocess.TimeoutExpired:
        os.killpg(running.proc.pid, signal.SIGKILL)
        code = running.proc.wait()
    remove_shared_memory_buffers(running.port)   # none expected on one GPU rank; never left behind
    summary = rundir.read_summary(running.run_dir)
    peak_file = running.run_dir.parent / "peak.json"
    return {"exit_code": code, "seconds": round(time.monotonic() - running.started, 1),
            "status": summary.status if summary else None, "error": summary.error if summary else None,
            "peak_memory": summary.peak_memory if summary else {},
            "peak": json.loads(peak_file.read_text()) if peak_file.is_file() else None,
            "log_tail": running.log.read_text(errors="replace").splitlines()[-20:] if code else []}


def finished(measured: dict) -> bool:
    """The job ran to its last step and its peak was read."""
    return measured["exit_code"] == 0 and measured["status"] == "finished" and \
        readings(measured)["max_memory_allocated_gib"] is not None


def readings(measured: dict | None) -> dict:
    """The calibration file's readings (GiB) from the worker's summary.json maxima (MiB)."""
    peaks = (measured or {}).get("peak_memory") or {}

    def gib(key: str) -> float | None:
        return None if peaks.get(key) is None else round(peaks[key] / 1024, 2)
    return {"max_memory_allocated_gib": gib("mem/peak_allocated_mib_max"),
            "max_memory_reserved_gib": gib("mem/peak_reserved_mib_max"),
            "nvml_used_gib": gib("mem/nvml_used_mib_max")}


def plan_readings(plan: MemoryPlan) -> dict:
    return {"peak_allocated_gib": round(plan.peak_allocated / GiB, 2),
            "peak_reserved_gib": round(plan.peak_reserved / GiB, 2),
            "nvml_total_gib": round(plan.nvml_total / GiB, 2)}


def job_record(planned: Planned, measured: dict | None, how: str = HOW) -> dict:
    """One entry of the calibration file's `jobs` (measured None: a dry run's, readings null)."""
    return {"name": planned.job.name, "spec": run_spec(planned.job), "how": how, "note": planned.job.note,
            "readings": readings(measured), "plan_when_measured": plan_readings(planned.plan)}


def context_entry(name: str, measured: dict) -> dict | None:
    """NVML's used memory beside torch's reserved maximum: the CUDA context and what else the process holds."""
    peaks = measured.get("peak_memory") or {}
    nvml, reserved = peaks.get("mem/nvml_used_mib_max"), peaks.get("mem/peak_reserved_mib_max")
    if nvml is None or reserved is None:
        return None
    return {"what": f"NVML used - torch max reserved, {name}", "nvml_mib": round(nvml), "reserved_mib": round(reserved)}


def peak_entry(planned: Planned, measured: dict | None) -> dict:
    """The peaks file's entry: the planner's breakdown beside the allocator's at the recorded step's peak."""
    plan = planned.plan
    return {"plan_gib": {**{k: round(v / GiB, 3) for k, v in plan.breakdown.items()},
                         "peak_allocated": round(plan.peak_allocated / GiB, 3)},
            "measured_gib": readings(measured),
            **({} if measured is None else {k: measured[k] for k in
                                            ("exit_code", "status", "error", "seconds", "log_tail", "peak")})}


# --- the calibration file --------------------------------------------------------------------------

def gpu_info() -> dict:
    """GPU 0's name and NVML's total memory (NVML: the parent never creates a CUDA context, which would
    count in every job's NVML reading); None where there is no NVIDIA GPU."""
    from jobspec import hardware
    names, total = hardware.gpu_names(), hardware.gpu_total_bytes()
    if not names or total is None:
        return {"name": None, "memory_gib": None}
    return {"name": names[0], "memory_gib": round(total / GiB, 1)}


def versions() -> dict:
    from importlib import metadata

    import torch
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": metadata.version("transformers"), "deepspeed": metadata.version("deepspeed")}


def slug(gpu_name: str) -> str:
    """"NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower().replace("nvidia", "")).strip("-") or "gpu"


def default_out(gpu_name: str, date: str) -> Path:
    """bench/calibration/<gpu>-<date>.json; -2, -3 ... when a calibration of that day is there already."""
    base = CALIBRATION_DIR / f"{slug(gpu_name)}-{date}"
    path, n = base.with_suffix(".json"), 2
    while path.exists():
        path, n = Path(f"{base}-{n}.json"), n + 1
    return path


def peaks_path(out: Path) -> Path:
    """The breakdowns' file: a folder down, so that bench/calibration/*.json stays calibration files."""
    return out.parent / "peaks" / out.name


@dataclass
class Calibration:
    """What one run has so far, written whole after every job."""

    out: Path
    gpu: dict
    source: str
    records: list = field(default_factory=list)
    context: list = field(default_factory=list)
    peaks: dict = field(default_factory=dict)

    def add(self, planned: Planned, measured: dict | None, how: str = HOW) -> None:
        """A job's plan and what it measured (None: a dry run's plan alone); a job that did not finish
        goes to the peaks file only."""
        if measured is None or finished(measured):
            self.records.append(job_record(planned, measured, how))
        entry = context_entry(planned.job.name, measured) if measured and finished(measured) else None
        if entry is not None:
            self.context.append(entry)
        self.peaks[planned.job.name] = peak_entry(planned, measured)
        self.write()

    def write(self) -> None:
        document = {"gpu": self.gpu["name"], "gpu_memory_gib": self.gpu["memory_gib"],
                    "date": datetime.date.today().isoformat(), "versions": versions(), "source": self.source,
                    "context": self.context, "jobs": self.records,
                    # measured by `python -m bench gpu-throughput`, not here
                    "matmul": None, "throughput": []}
        for path, data in ((self.out, document), (peaks_path(self.out), self.peaks)):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, path)   # a run killed mid-write leaves the previous job's file whole


# --- printing --------------------------------------------------------------------------------------

def describe(planned: Planned) -> str:
    """What sets the job apart, in one line."""
    spec, derived = planned.job.spec, planned.prepared.derived
    model_section, memory = spec["model"], spec["memory"]
    ckpt = memory.get("activation_checkpointing")
    parts = [f"{model_section['architecture']} {(derived.num_parameters or 0) / 1e6:.0f}M params",
             memory["precision"], planned.prepared.spec["model"]["attention"],
             f"seq {derived.seq_len} x micro-batch {derived.micro_batch_size}"]
    if ckpt:
        every = ckpt.get("every_n_layers", 1) if isinstance(ckpt, dict) else 1
        offload = ckpt.get("offload") if isinstance(ckpt, dict) else None
        parts.append("checkpointing" + (f" every {every}" if every != 1 else "")
                     + (f", inputs offloaded to {offload}" if offload and offload != "none" else ""))
    parts += [what for key, what in (("tiled_loss", "tiled loss"), ("tiled_mlp", "tiled MLP")) if memory.get(key)]
    if model_section.get("quantization"):
        parts.append(f"QLoRA {model_section['quantization']['bits']}-bit")
    elif model_section.get("lora"):
        parts.append("LoRA")
    if memory.get("zero_stage"):
        parts.append(f"ZeRO-{memory['zero_stage']}")
    return ", ".join(parts)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[tuple[Planned, dict, float | None]], measured_label: str = "measured") -> str:
    """Markdown: plan against measurement per job (rows: planned job, readings, seconds)."""
    lines = [f"| job | plan GiB | {measured_label} GiB | plan / measured | reserved GiB, plan / measured | "
             "NVML GiB, plan / measured | s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for planned, got, seconds in rows:
        plan = plan_readings(planned.plan)
        measured = got["max_memory_allocated_gib"]
        ratio = "-" if not measured else f"{plan['peak_allocated_gib'] / measured:.2f}"
        lines.append(f"| {planned.job.name} | {plan['peak_allocated_gib']:.2f} | {_gib(measured)} | {ratio} | "
                     f"{plan['peak_reserved_gib']:.2f} / {_gib(got['max_memory_reserved_gib'])} | "
                     f"{plan['nvml_total_gib']:.2f} / {_gib(got['nvml_used_gib'])} | "
                     f"{'-' if seconds is None else f'{seconds:.0f}'} |")
    return "\n".join(lines)


def _say(what: str) -> None:
    print(f"gpu-calibrate: {what}", file=sys.stderr, flush=True)


# --- the command -----------------------------------------------------------------------------------

SOURCE = (f"python -m bench gpu-calibrate: one rank, synthetic tokens, {STEPS} steps; readings: the worker's "
          f"summary.json maxima over the steps; the allocator's history of step {SNAPSHOT_STEP} in peaks/ "
          "beside this file")


def dry_run(jobs: list[Job], args: argparse.Namespace, work: Path) -> int:
    """Plan and compile every job here; print the plans, what a GPU run measures and its time."""
    from jobspec.errors import SpecError
    started, planned, failed = time.monotonic(), [], []
    for job in jobs:
        try:
            planned.append(plan_job(job, work))
            compile_run(planned[-1], work / job.name / "run")
            _say(f"{job.name}: planned in {planned[-1].plan_s:.1f} s")
        except SpecError as err:
            failed.append(job.name)
            print(f"{job.name}:\n{err.render()}", file=sys.stderr)
    print_dry_run(planned, args.budget_s)
    print(f"planned here in {time.monotonic() - started:.0f} s")
    if args.out:
        calibration = Calibration(args.out, gpu_info(), "dry run: planned here, nothing measured")
        for p in planned:
            calibration.add(p, None, how="dry run: planned, not measured")
        _say(f"written to {args.out}")
    return 1 if failed else 0


def print_dry_run(planned: list[Planned], budget_s: float) -> None:
    """What a GPU run does, the plans beside the first calibration's readings, the jobs, the time."""
    before = {j["name"]: j["readings"] for j in json.loads(FIRST_CALIBRATION.read_text())["jobs"]}
    print(f"python -m bench gpu-calibrate --dry-run: {len(planned)} jobs planned (nothing runs here)\n")
    print(f"On a GPU each job runs as `python -m bench.gpu_calibrate --child RUN_DIR`: the worker, one rank, "
          f"{STEPS} steps; it reads summary.json's torch max allocated / max reserved / NVML used, and the "
          f"allocator's history of step {SNAPSHOT_STEP} (at most {MAX_ENTRIES} events) broken down at its peak.\n")
    print(table([(p, before.get(p.job.name, readings(None)), p.estimate_s) for p in planned],
                f"measured ({FIRST_CALIBRATION.stem})"))
    print("\n(s: the estimated time on the GPU, start to exit)\n")
    for p in planned:
        print(f"- {p.job.name}: {describe(p)}" + (f" ({p.job.note})" if p.job.note else ""))
    total = sum(p.estimate_s for p in planned)
    print(f"\nestimated on one H200: {total:.0f} s for {len(planned)} jobs, plus the first job's planning "
          f"(the others' overlap a running job); no job starts after --budget-s {budget_s:.0f} s")


def calibrate(jobs: list[Job], args: argparse.Namespace, work: Path, gpu: dict) -> int:
    """Each job planned, run and recorded; the table at the end."""
    started = time.monotonic()
    calibration = Calibration(args.out or default_out(gpu["name"], datetime.date.today().isoformat()), gpu, SOURCE)
    rows, skipped = run_jobs(jobs, work, calibration, started + args.budget_s, hide_gpus())
    print(table(rows))
    if skipped:
        print(f"\nnot started (past --budget-s {args.budget_s:.0f} s): {', '.join(skipped)}")
    print(f"\n{len(rows)} jobs in {time.monotonic() - started:.0f} s on {gpu['name']}; "
          f"{calibration.out} and {peaks_path(calibration.out)}")
    return 0 if rows and all(got["max_memory_allocated_gib"] is not None for _, got, _ in rows) else 1


def run_jobs(jobs: list[Job], work: Path, calibration: Calibration, deadline: float,
             rank_gpus: dict[str, str]) -> tuple[list, list[str]]:
    """(rows of the jobs that ran, names of those not started by `deadline`). The next job is planned
    while the one before runs; a job that cannot be planned or compiled is reported and passed over."""
    import signal

    from jobspec.errors import SpecError
    rows: list = []
    skipped: list[str] = []
    running: Running | None = None
    try:
        for i, job in enumerate(jobs, 1):
            try:
                planned: Planned | None = plan_job(job, work)
            except SpecError as err:
                planned = None
                _say(f"{job.name}: not planned, not run:\n{err.render()}")
            if running is not None:
                rows.append(collect(running, calibration))
                running = None
            if planned is None:
                continue
            if time.monotonic() > deadline:
                skipped.append(job.name)
                continue
            _say(f"[{i}/{len(jobs)}] {job.name}: planned {planned.plan.peak_allocated / GiB:.2f} GiB, "
                 f"about {planned.estimate_s:.0f} s")
            try:
                running = start(planned, work, rank_gpus)
            except SpecError as err:
                _say(f"{job.name}: not compiled, not run:\n{err.render()}")
        if running is not None:
            rows.append(collect(running, calibration))
            running = None
    finally:   # stopped (Ctrl-C, a session's time limit): the job's rank must not hold the GPU on
        if running is not None and running.proc.poll() is None:
            os.killpg(running.proc.pid, signal.SIGKILL)
    return rows, skipped


def collect(running: Running, calibration: Calibration) -> tuple[Planned, dict, float]:
    measured = finish(running)
    calibration.add(running.planned, measured)
    got = readings(measured)
    _say(f"{running.planned.job.name}: exit {measured['exit_code']} in {measured['seconds']:.0f} s, "
         f"max allocated {_gib(got['max_memory_allocated_gib'])} GiB (plan "
         f"{running.planned.plan.peak_allocated / GiB:.2f})")
    return running.planned, got, measured["seconds"]


def select(jobs: list[Job], names: str | None) -> list[Job]:
    if not names:
        return jobs
    by_name = {j.name: j for j in jobs}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"gpu-calibrate: no job {', '.join(unknown)}; the jobs: {', '.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu-calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="plan every job and print what a GPU run does")
    parser.add_argument("--jobs", default=None, metavar="NAME,...", help="only these jobs (default: all)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the calibration file (default bench/calibration/<gpu>-<date>.json; "
                             "a dry run writes one only when given)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"start no job after this many seconds (default {BUDGET_S})")
    parser.add_argument("--work", type=Path, default=WORK, help="job files, run dirs, logs (default bench/work/...)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)   # RUN_DIR: one job's rank
    parser.add_argument("--peak-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.peak_out, SNAPSHOT_STEP, MAX_ENTRIES)
    jobs = select(all_jobs(), args.jobs)
    work = args.work.resolve()
    if args.dry_run:
        return dry_run(jobs, args, work)
    gpu = gpu_info()
    if gpu["name"] is None:
        print("gpu-calibrate: no NVIDIA GPU here (NVML); --dry-run plans the jobs", file=sys.stderr)
        return 2
    return calibrate(jobs, args, work, gpu)


if __name__ == "__main__":
    raise SystemExit(main())
