"""What `jobspec launch` prints: the header, the GPU-sized warning, the closing summary (plain-lines
and bar mode), the terminal filter, the launch intent (fresh / resume / complete) and the
scheduler's start (no DeepSpeed warning; HF's linear schedule step by step)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jobspec.launch import intent
from jobspec.hardware import Host
from jobspec.launch.quiet import TerminalFilter
from jobspec.memory import at_launch
from jobspec.memory.fit import cpu_step_time
from jobspec.rundir import RunSummary
from jobspec.launch import console
from jobspec.spec.inputs import derive_job
from jobspec.spec.validation import load_and_validate
from jobspec.units import fmt_mib_gib
from conftest import PROFILER, REPO_ROOT

REPO = REPO_ROOT
GiB = 2**30
CPU_HOST = Host(cpus=2, ram_total=16 * GiB, ram_available=12 * GiB)
H100 = Host(gpu_names=("NVIDIA H100 80GB HBM3",), gpu_free=79 * GiB, gpu_total=80 * GiB, cpus=16,
            ram_total=128 * GiB, ram_available=120 * GiB)


def prepared(job: str, *overrides: str, gpu_free=None, cpu_ranks=False):
    resolved = load_and_validate(REPO / "jobs" / job, list(overrides))
    derived = derive_job(resolved.spec, profiler=PROFILER)
    resolved, derived, memory = at_launch.plan_at_launch(resolved, derived, gpu_free,
                                                         cpu_ranks=cpu_ranks)
    from jobspec.compile.compiler import compile_spec
    return resolved.spec, derived, memory, compile_spec(resolved.spec, derived, run_dir="RUN").patches


def both_modes(render):
    """The lines in plain-lines mode, and bar mode's lines without their styling (the same words)."""
    plain, styled = render(False), render(True)
    assert not any("\x1b[" in line for line in plain)
    assert any("\x1b[1m" in line for line in styled)
    assert console.plain(styled) == "\n".join(plain)
    return "\n".join(plain)


def test_header_on_cpu_ranks_names_the_job_model_settings_hardware_and_plan():
    spec, job, memory, patches = prepared("quickstart.yaml", cpu_ranks=True)
    text = both_modes(lambda style: console.header_lines(spec, job, memory, CPU_HOST, patches, style=style))
    assert text.startswith(f"jobspec: quickstart: xlm-roberta sequence-classification, "
                           f"{console.fmt_count(job.num_parameters)} parameters")
    assert job.num_parameters == 143810 and "143.8K parameters" in text
    assert f"{job.precision} · ZeRO-0 · no offload" in text
    assert f"global batch {job.global_batch_size} ({job.micro_batch_size} per rank x 2 ranks)" in text
    assert f"{job.total_steps} steps · sequence length {job.seq_len}" in text
    assert "no GPU: 2 CPU ranks on 2 CPU cores; world size 2" in text
    # one figure on CPU ranks: host RAM, the process and the tensors a GPU would hold
    plan = memory.plan
    assert plan.cpu_ranks and plan.host["tensors"] == plan.peak_allocated
    assert plan.host_total == plan.host["runtime"] + max(plan.host["construction"], sum(
        v for k, v in plan.host.items() if k not in ("runtime", "construction")))
    per_rank, node = fmt_mib_gib(plan.host_total), fmt_mib_gib(2 * plan.host_total)
    assert f"host RAM    plan {per_rank} per rank (the process and its tensors: " \
           f"{fmt_mib_gib(plan.peak_allocated)} at the peak), {node} per node" in text
    assert "12.00 GiB available now" in text
    assert "\n  memory " not in text and "per GPU" not in text
    assert "model       attention sdpa" in text  # what the ranks used to print as "attention: sdpa"
    assert console.gpu_sized_warning(spec, job, memory, CPU_HOST, cpu_step_time(job, 2)) == []


def test_header_on_a_gpu_host_sets_the_plan_against_the_gpu():
    spec, job, memory, patches = prepared("xlmr-large.yaml", gpu_free=79 * GiB)
    text = "\n".join(console.header_lines(spec, job, memory, H100, patches))
    assert "559.9M parameters" in text and "bf16 · ZeRO-0 · no offload" in text
    assert "NVIDIA H100 80GB HBM3 x 1 on this host; world size 1 (1 rank)" in text
    assert f"plan {fmt_mib_gib(memory.plan.nvml_total)} per GPU" in text
    assert "79.00 GiB free of 80.00 GiB: fits" in text
    assert "attention sdpa · activation checkpointing every layer" in text
    small = Host(gpu_names=("NVIDIA T4",), gpu_free=4 * GiB, gpu_total=16 * GiB)
    assert "DOES NOT FIT" in "\n".join(console.header_lines(spec, job, memory, small, patches))
    offload = prepared("xlmr-large.yaml", "memory.zero_stage=2", "memory.offload.optimizer=cpu")
    assert "ZeRO-2 · offload optimizer to cpu" in "\n".join(console.header_lines(*offload[:3], H100, offload[3]))


def test_the_header_notes_lora_on_a_base_of_random_weights():
    spec, job, memory, patches = prepared("lora-causal-lm.yaml")
    lines = console.header_lines(spec, job, memory, CPU_HOST, patches)
    assert [line for line in lines if line.startswith("  note ")] == [
        "  note        model.lora on a qwen2 built from model.config: the adapters train on a "
        "frozen base of random weights (set model.name_or_path to adapt a pretrained model)"]
    spec, job, memory, patches = prepared("quickstart.yaml")   # no LoRA: no note
    lines = console.header_lines(spec, job, memory, CPU_HOST, patches)
    assert not any(line.startswith("  note ") for line in lines)


def test_a_gpu_sized_job_on_cpu_ranks_is_said_with_the_planners_step_time():
    spec, job, memory, _ = prepared("xlmr-large.yaml")
    step = cpu_step_time(job, 2)
    # the derived job's FLOPs for the whole global batch, over the cores at the assumed CPU rate
    assert step == pytest.approx(job.hardware_flops_per_token * 8 * 512 / (2 * 50e9), rel=8 * 2**-53)   # <= 4 ops each side
    warning = "\n".join(console.gpu_sized_warning(spec, job, memory, CPU_HOST, step))
    assert warning.startswith("WARNING: xlmr-large is sized for GPUs and this host has none: the planner "
                              f"estimates {console.fmt_duration(step)} per step on these 2 CPU cores")
    assert f"for {job.total_steps} steps" in warning and "Ctrl-C" in warning
    assert console.gpu_sized_warning(spec, job, memory, H100, step) == []
    # the memory half of the rule: a plan larger than the RAM available, however fast
    tiny_ram = Host(cpus=64, ram_total=8 * GiB, ram_available=4 * GiB)
    assert "more than the 4.00 GiB of RAM available" in "\n".join(
        console.gpu_sized_warning(spec, job, memory, tiny_ram, 1.0))


SUMMARY = {"status": "finished", "steps": 40, "total_steps": 40, "samples": 1280, "final_loss": 0.0155,
           "eval_loss": 0.0135, "samples_per_s": 432.2, "tokens_per_s": 27659.3, "tflops_per_device": None,
           "mfu": None, "peak_memory": {"mem/host_rss_mib_max": 613.8}, "elapsed_s": 34.2,
           "checkpoint": "step40"}
LAUNCH = {"plan": {"peak_allocated_mib": 9.3, "peak_reserved_mib": 10.7, "nvml_total_mib": 510.7,
                   "host_total_mib": 1034.5}}
CPU_LAUNCH = {"plan": {"host_total_mib": 1034.5, "host_tensors_mib": 9.3}}   # no GPU figure
TRACKING = {"tracking_uri": "sqlite:///mlflow.db", "experiment_id": "3", "run_id": "abc123"}


def closing(summary, **kw):
    args = dict(job_name="quickstart", run_dir="/r/run-1", checkpoint_dir="/r/checkpoints", exit_code=0,
                tracking=TRACKING, experiment="quickstart")
    args.update(kw)
    launch = args.pop("launch", LAUNCH)
    typed = RunSummary.from_dict(summary) if summary is not None else None   # summary.json as the launcher reads it
    return both_modes(lambda style: console.closing_lines(typed, launch, style=style, **args))


def test_closing_summary_of_a_finished_cpu_run():
    text = closing(SUMMARY, launch=CPU_LAUNCH)
    lines = text.splitlines()
    assert lines[0] == "jobspec: quickstart finished: 40/40 steps in 34 s (exit 0)"
    assert "loss        train 0.0155 · eval 0.0135" in text
    assert "throughput  432.2 samples/s · 27,659 tokens/s" in text and "TFLOP/s" not in text
    assert "host RAM    peak RSS 613.8 MiB (plan 1.01 GiB) per rank" in text
    assert "memory " not in text
    assert "checkpoint  /r/checkpoints/step40" in text and "run dir     /r/run-1" in text
    assert "MLflow      run abc123 in experiment 'quickstart'" in text
    assert f"mlflow ui --backend-store-uri sqlite:///{Path('mlflow.db').resolve()}  then  " \
           "http://127.0.0.1:5000/#/experiments/3/runs/abc123" in text


def test_closing_summary_shows_the_last_evaluations_task_metrics():
    text = closing({**SUMMARY, "eval_metrics": {"eval/accuracy": 0.875, "eval/f1": 0.86666}})
    assert "loss        train 0.0155 · eval 0.0135\n  eval        accuracy 87.5% · F1 0.8667\n" in text
    assert "perplexity 12.35" in closing({**SUMMARY, "eval_metrics": {"eval/perplexity": 12.3456}})
    assert "\n  eval " not in closing(SUMMARY)   # no evaluation metrics: no line


def test_closing_summary_on_gpu_has_tflops_mfu_and_memory_next_to_the_plan():
    gpu = {**SUMMARY, "tflops_per_device": 151.234, "mfu": 0.3712,
           "peak_memory": {"mem/peak_allocated_mib_max": 9.8, "mem/nvml_used_mib_max": 520.0,
                           "mem/host_rss_mib_max": 613.8},
           "exports": {"final": {"path": "/r/model", "step": 40}}}
    text = closing(gpu, tracking={**TRACKING, "tracking_uri": "http://mlflow:5000/"})
    assert "151.2 TFLOP/s per GPU · MFU 37.1%" in text
    assert "memory      peak allocated 9.8 MiB (plan 9.3 MiB) · GPU total 520.0 MiB " \
           "(plan 510.7 MiB) per GPU" in text
    assert "host RAM    peak RSS 613.8 MiB (plan 1.01 GiB) per rank" in text   # the host's too
    assert "model       final: /r/model (step 40)" in text
    assert "http://mlflow:5000/#/experiments/3/runs/abc123" in text and "mlflow ui" not in text


def test_closing_summary_says_where_mlflow_has_each_exported_model():
    exports = {"final": {"path": "/r/model/final", "step": 40}, "best": {"path": "/r/model/best", "step": 30}}
    tags = {"jobspec.export.final": "/r/model/final", "jobspec.export.final.artifact": "model/final",
            "jobspec.export.best": "/r/model/best",
            "jobspec.export.best.artifact": "not uploaded: 2.5 MB > export.mlflow_max_mb 1"}
    text = closing({**SUMMARY, "exports": exports}, model_tags=tags)
    assert "model       final: /r/model/final (step 40) · MLflow artifacts model/final" in text
    assert "model       best: /r/model/best (step 30) · not uploaded to MLflow: 2.5 MB > export.mlflow_max_mb 1" \
        in text
    failed = closing({**SUMMARY, "exports": exports},
                     model_tags={"jobspec.export.final.artifact": "upload failed: connection refused"})
    assert "final: /r/model/final (step 40) · MLflow upload failed: connection refused" in failed
    assert "best: /r/model/best (step 30)\n" in failed + "\n"   # no tag: nothing said about MLflow


def test_closing_summary_says_the_exit_status_in_words():
    stopped = closing({**SUMMARY, "status": "preempted", "steps": 12, "checkpoint": "step12"})
    assert stopped.startswith("jobspec: quickstart stopped at step 12 of 40 with a checkpoint (exit 0); "
                              "the command below continues from it")
    by_flag = closing({**SUMMARY, "status": "preempted", "steps": 4}, exit_code=75)   # --stop-after-steps
    assert by_flag.startswith("jobspec: quickstart stopped at step 4 of 40 with a checkpoint (exit 75)")
    interrupted = closing({**SUMMARY, "status": "preempted", "steps": 7, "checkpoint": "step7"}, exit_code=75,
                          user_signal="SIGINT")
    assert interrupted.startswith("jobspec: quickstart stopped by SIGINT at step 7 of 40 with a checkpoint (exit 75)")
    # a second Ctrl-C ended it before the ranks saved: no promise of a resume from this stop
    at_once = closing({"status": "killed", "total_steps": 40}, exit_code=130, user_signal="SIGINT")
    assert at_once.splitlines()[0] == "jobspec: quickstart stopped by SIGINT before a checkpoint was saved (exit 130)"
    assert "resume" not in at_once
    failed = closing({"status": "failed", "error": "CUDA out of memory\nTraceback ..."}, exit_code=1,
                     reason="runner exited with code 1\nlast lines")
    assert failed.splitlines()[0] == "jobspec: quickstart FAILED (exit 1): runner exited with code 1"
    assert "loss" not in failed and "run dir     /r/run-1" in failed
    nothing = closing(None, exit_code=137, reason=None, tracking=None)
    assert nothing.splitlines() == ["jobspec: quickstart FAILED (exit 137)", "  run dir     /r/run-1"]


def test_mlflow_open_for_local_stores_and_servers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert console.mlflow_open("sqlite:///mlflow.db", "1", "r") == \
        f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db  then  http://127.0.0.1:5000/#/experiments/1/runs/r" \
        "?workflowType=machine_learning"
    assert console.mlflow_open("sqlite:////abs/m.db", "1", "r").startswith("mlflow ui --backend-store-uri sqlite:////abs/m.db ")
    # the run page of model training, not MLflow 3's GenAI mode (where the run is under "Evaluations")
    assert console.mlflow_open("https://ml.example.org/", "7", "r") == \
        "https://ml.example.org/#/experiments/7/runs/r?workflowType=machine_learning"


# --- the terminal filter -------------------------------------------------------------------------

DS_LINES = [
    b"[2026-11-23 07:40:19,681] [INFO] [launch.py:152:main] WORLD INFO DICT: {'localhost': [0, 1]}\n",
    b"[2026-11-23 07:40:14,080] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. "
    b"If you have GPU or other accelerator, we were unable to detect it.\n",
    b"[2026-11-23 07:40:15,969] [WARNING] [runner.py:214:fetch_hostfile] Unable to find hostfile, will proceed "
    b"with training with local resources only.\n",
    b"DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n",
    b"2026/11/23 07:40:11 INFO mlflow.store.db.utils: Creating initial MLflow database tables...\n",
    b"jobspec-log: phase rank0 start 1795420837.090 0.000\n",
    b"Using /root/.cache/torch_extensions/py311_cpu as PyTorch extensions root...\n",
]
KEPT = [
    b"[2026-11-23 07:40:41,104] [WARNING] [engine.py:1:x] Something about the job itself\n",
    b"step 5/40 loss 0.6969 lr 2.8e-03 349.0 samples/s eta 0:00:16\n",
    b"jobspec: building DeepSpeed op shm_comm (first run only, cached in ~/.cache/torch_extensions/x)\n",
    b"/x/y.py:3: UserWarning: something worth reading\n",
    b"[2026-11-23 07:40:41,104] [ERROR] [engine.py:1:x] a DeepSpeed error\n",
]


def test_the_terminal_gets_no_library_chatter_but_every_warning_and_progress_line():
    stream = b"".join(DS_LINES[:3] + KEPT[:2] + DS_LINES[3:] + KEPT[2:])
    for size in (1, 7, 64, len(stream)):  # the relay's chunks cut lines anywhere
        flt = TerminalFilter()
        shown = b"".join(flt.feed(stream[i:i + size]) for i in range(0, len(stream), size)) + flt.flush()
        assert shown == b"".join(KEPT), size


def test_a_progress_bar_redraw_passes_at_once():
    flt = TerminalFilter()
    assert flt.feed(b"\r 10%|#    | 4/40 [00:01<00:09]") == b"\r 10%|#    | 4/40 [00:01<00:09]"
    assert flt.feed(b"\r 20%|##   | 8/40") == b"\r 20%|##   | 8/40"
    assert flt.feed(b" [00:02<00:08]\n") == b" [00:02<00:08]\n"
    assert flt.feed(b"[2026-11-23 07:40:50,915] [INFO] [launch.py:285:main] Process 1 exits successfully.\n") == b""
    assert flt.feed(b"no newline yet") == b"" and flt.flush() == b"no newline yet"
    # another rank's log line lands after a redraw, on the bar's line: still left out
    flt = TerminalFilter()
    assert flt.feed(b"\r  2%|         | 1/40") == b"\r  2%|         | 1/40"
    assert flt.feed(b"jobspec-log: phase rank1 first-step 1795424177.338 5.580\n") == b""
    assert flt.feed(b"\r  5%|#        | 2/40") == b"\r  5%|#        | 2/40"
    assert flt.feed(b"UserWarning: kept\n") == b"UserWarning: kept\n"


def test_a_hidden_line_read_together_with_a_bar_redraw_is_still_left_out():
    # two ranks share the pipe: one read can hold rank 0's redraw and rank 1's log line after it
    log = b"jobspec-log: phase rank1 first-step 1795424177.338 5.580\n"
    ds = b"[2026-11-23 07:40:50,915] [INFO] [engine.py:1:x] rank 1 ready\n"
    # a redraw is one write; the read may cut the line after it anywhere (a DeepSpeed record once its
    # timestamp is whole: rank 1's jobspec-log lines are the ones that come every step)
    for tail, cuts in ((log, range(len(log) + 1)), (ds, range(26, len(ds) + 1))):
        for cut in [0, *cuts]:
            flt = TerminalFilter()
            chunks = [b"\r 10%|#    | 4/40" + tail[:cut], tail[cut:] + b"\r 20%|##   | 8/40", b"\n"]
            got = b"".join(flt.feed(chunk) for chunk in chunks) + flt.flush()
            assert got == b"\r 10%|#    | 4/40\r 20%|##   | 8/40\n", (cut, got)
    # after a redraw that was already shown, the same
    flt = TerminalFilter()
    assert flt.feed(b"\r  2%|         | 1/40") == b"\r  2%|         | 1/40"
    assert flt.feed(b"\r  5%|#        | 2/40" + log) == b"\r  5%|#        | 2/40"
    assert flt.feed(b"UserWarning: kept\n") == b"UserWarning: kept\n"


# --- what a launch would do ----------------------------------------------------------------------

def ckpt_spec(tmp_path, resume="auto"):
    return {"name": "j", "output_dir": str(tmp_path), "checkpoint": {"dir": str(tmp_path / "ck"), "resume": resume}}


def save(ckpt: Path, step: int, complete: bool = True):
    (ckpt / f"step{step}").mkdir(parents=True)
    if complete:
        (ckpt / f"step{step}" / intent.MANIFEST).write_text("{}")
    (ckpt / intent.LATEST).write_text(f"step{step}")


def test_intent_fresh_resume_or_complete(tmp_path):
    spec = ckpt_spec(tmp_path)
    assert intent.decide(spec, 40) == intent.Intent("fresh", 40)
    save(tmp_path / "ck", 12)
    assert intent.decide(spec, 40) == intent.Intent("resume", 40, 12, tmp_path / "ck" / "step12")
    save(tmp_path / "ck", 40)
    done = intent.decide(spec, 40)
    assert done.action == "complete" and done.step == 40
    assert "do nothing: the job is complete" in done.describe()
    assert intent.decide(spec, 60).describe() == f"resume from {tmp_path / 'ck' / 'step40'} at step 40 and train to step 60"
    assert intent.decide(ckpt_spec(tmp_path, "never"), 40).action == "fresh"
    assert intent.decide(ckpt_spec(tmp_path, str(tmp_path / "ck" / "step12")), 40).step == 12
    save(tmp_path / "other", 50, complete=False)  # its save did not finish: the ranks pass it over
    assert intent.decide(ckpt_spec(tmp_path, str(tmp_path / "other")), 50).action == "resume"


# --- DeepSpeed's scheduler, started at iteration 0 -----------------------------------------------

def test_scheduler_starts_without_warning_and_follows_hf_linear_schedule(caplog):
    import torch
    from deepspeed.runtime import lr_schedules
    from transformers import get_linear_schedule_with_warmup

    from jobspec.compile.compiler import compile_spec
    from jobspec.spec.derived import derive
    from jobspec.spec.schema import fill_defaults
    from jobspec.train.engine import start_schedule

    spec = fill_defaults({"model": {"architecture": "bert", "config": {"hidden_size": 8, "num_hidden_layers": 1,
                                                                       "num_attention_heads": 1}},
                          "data": {"synthetic": {"num_samples": 64}},
                          "training": {"max_steps": 12, "optimizer": {"lr": 1e-3},
                                       "scheduler": {"name": "linear", "warmup_steps": 3}}})
    block = compile_spec(spec, derive(spec, profiler=PROFILER), run_dir="RUN").ds_config["scheduler"]

    class Engine:  # what start_schedule reads of a DeepSpeed engine
        def __init__(self):
            self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
            self.lr_scheduler = getattr(lr_schedules, block["type"])(self.optimizer, **block["params"])

    with caplog.at_level(logging.WARNING):
        engine = Engine()
        start_schedule(engine)
    assert "before it has started" not in caplog.text
    reference_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    reference = get_linear_schedule_with_warmup(reference_optimizer, 3, 12)
    for _ in range(12):  # the lr each optimizer step runs with, then the step
        # the same linear warm-up and decay in two libraries' formulas: a few float64 operations each,
        # under 8 roundings of 2**-53 between them
        assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(reference_optimizer.param_groups[0]["lr"],
                                                                        rel=8 * 2**-53, abs=0)
        engine.lr_scheduler.step()
        reference_optimizer.step()
        reference.step()


def test_compile_without_out_lists_the_patches_on_stderr(capsys):
    from jobspec.cli import main
    assert main(["compile", str(REPO / "jobs" / "xlmr-large.yaml")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["train_micro_batch_size_per_gpu"] == 8  # stdout stays ds_config.json
    assert 'patch: gradient_checkpointing every_n_layers=1 use_reentrant=false  (activation checkpointing ' \
           'every layer)' in err
    assert 'patch: attention_implementation implementation="sdpa"' in err


def test_closing_summary_shows_the_lora_settings_beside_the_trainable_parameters():
    lora = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "modules_to_save": None,
            "bias": "none", "use_rslora": True, "use_dora": False}
    qlora = {"lora": lora, "quantization": {"bits": 4, "quant_type": "nf4", "compute_dtype": "bf16",
                                            "double_quant": True}}
    trained = {**SUMMARY, "parameters": {"trainable": 1_234, "total": 98_765}}
    text = closing(trained, model_spec=qlora)
    assert ("  parameters  1,234 trainable of 98,765 (1.25%)\n"
            "  adapter     LoRA r 8 · alpha 16 · targets q_proj, v_proj · rsLoRA · base 4-bit nf4 "
            "(double quant, compute bf16)\n") in text
    # the defaults as the resolved spec writes them: all-linear, 8-bit, compute `auto` (the training precision)
    int8 = {"lora": {**lora, "target_modules": "all-linear", "use_rslora": False, "alpha": 0.5},
            "quantization": {"bits": 8, "quant_type": "nf4", "compute_dtype": "auto", "double_quant": True}}
    assert "adapter     LoRA r 8 · alpha 0.5 · targets all-linear · base 8-bit (LLM.int8)\n" in closing(trained,
                                                                                                      model_spec=int8)
    assert "base 4-bit fp4\n" in closing(trained, model_spec={"lora": lora, "quantization": {
        "bits": 4, "quant_type": "fp4", "compute_dtype": "auto", "double_quant": False}})
    # no LoRA (a full fine-tune, model.freeze): no adapter line
    assert "adapter" not in closing(trained, model_spec={"lora": None, "quantization": None})
    assert "adapter" not in closing(trained)


def test_header_says_the_lora_patch_and_the_optimizer_the_ranks_build():
    # LoRA is a compiled patch like the others; the optimizer jobspec builds is no patch but still said
    spec, job, memory, patches = prepared("quickstart.yaml", "training.optimizer.name=adafactor", "model.lora.r=4",
                                          "model.lora.target_modules=[query, value]")
    assert [p["name"] for p in patches] == ["attention_implementation", "lora"]
    text = "\n".join(console.header_lines(spec, job, memory, CPU_HOST, patches))
    assert ("model       attention sdpa · optimizer adafactor, built by jobspec · LoRA r 4 alpha 16 on query, "
            "value") in text
