"""Every command, run cold (an empty JOBSPEC_CACHE_DIR, a fresh process each), leaves the terminal
to jobspec: no library warning, log record or progress bar reaches stdout or stderr; they go to the
command's log (jobspec/library_log.py) or the run's launcher.log (launch/quiet.py).

The job is as small as a job can be and still reach every library that talks: a Qwen2 of two
layers with LoRA on a 4-bit base (bitsandbytes' import, which says it lacks the `kernels` package
on an AVX512-BF16 CPU), activation checkpointing (transformers' `is_gradient_checkpointing`
FutureWarning in the planner's trace), chat records (the tokeniser, the data pass) and evaluation
generations (MLflow's artifact download in `report --generations`). One real launch (slow) is
shared by export and report.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

DATA = REPO_ROOT / "jobs" / "data"
# What the libraries print, never jobspec: their log records ("[WARNING]" from DeepSpeed, "INFO
# mlflow"), Python warnings (the category and the library file they come from), tqdm bars (their
# rate and their bar of blocks), and the leaks seen before: bitsandbytes' kernels note, MLflow's
# "Downloading artifacts" and the export's "Converting weights".
LIBRARY_PATTERNS = [re.compile(p) for p in (
    r"\[(WARNING|INFO|DEBUG|ERROR)\]",
    r"\b(INFO|WARNING) (mlflow|alembic)\b",
    r"\b[A-Za-z]*Warning: ",
    r"warnings\.warn\(",
    r"site-packages/",
    r"(it|s|tensor|B)/s\]",
    r"\d+%\|",
    r"[█▏▎▍▌▋▊▉]",
    r"Downloading",
    r"kernels-community",
    r"Converting weights",
    r"^\s*\[rank\d+\]",
)]


def library_lines(text: str) -> list[str]:
    """The lines (a carriage return starts one too: a bar's redraw) that a library printed."""
    lines = re.split(r"[\r\n]+", text)
    return [line for line in lines if any(p.search(line) for p in LIBRARY_PATTERNS)]


def test_the_patterns_catch_what_leaked_and_keep_jobspecs_own_lines():
    leaked = ("/usr/lib/python3.11/site-packages/transformers/modeling_utils.py:3312: "
              "FutureWarning: `is_gradient_checkpointing` is deprecated",
              "Failed to load CPU gemm_4bit_forward from kernels-community: No module named "
              "'kernels'",
              "[2026-11-28 10:00:00,000] [WARNING] [real_accelerator.py:214:get_accelerator] "
              "Setting accelerator to CPU.",
              "Converting weights: 100%|██████████| 27/27 [00:00<00:00, 189374.93tensor/s]",
              "Downloading artifacts:   0%|          | 0/1 [00:00<?, ?it/s]")
    assert all(library_lines(line) for line in leaked)
    own = ("jobspec: quiet: qwen2 causal-lm, 207.2K parameters",
           "  host RAM    plan 1.01 GiB per rank (the process and its tensors: 6.8 MiB at the "
           "peak)",
           "step 2/2 loss 7.6493 lr 2.5e-05 5.4 samples/s eta 0:00:00",
           "jobspec: tokenised data.train: 300 records in 0.3 s (1,144 records/s)",
           "WARNING: xlmr-large is sized for GPUs and this host has none",
           "wrote /tmp/x (0.9 MiB, fp32, step 2) from /tmp/c/step2 in 0.0 s")
    assert not library_lines("\n".join(own))


def write_quiet_job(tmp: Path) -> Path:
    eval_file = tmp / "eval.jsonl"
    records = (DATA / "chat-sample.jsonl").read_text().splitlines(keepends=True)
    eval_file.write_text("".join(records[:4]))
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
              "vocab_size": 2048, "tie_word_embeddings": True}
    job = {
        "name": "quiet",
        "model": {"architecture": "qwen2", "task": "causal-lm", "config": config,
                  "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                  "quantization": {"bits": 4}},
        "data": {"train": str(DATA / "chat-sample.jsonl"), "eval": str(eval_file),
                 "tokenizer": str(DATA / "tokenizer"), "records": "chat", "max_length": 64,
                 "num_workers": 0, "pin_memory": False},
        "training": {"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 2,
                     "eval_every": 2, "eval_generate": {"prompts": 1, "max_new_tokens": 2}},
        "memory": {"precision": "fp32", "activation_checkpointing": True},
        "resources": {"gpus_per_node": 1},
        "output_dir": str(tmp / "out"),
        "logging": {"every_n_steps": 1,
                    "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"}},
    }
    path = tmp / "quiet.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_cold(tmp: Path, *args: str, cache: str = "cold", timeout: int = 600,
             verbose: bool = False) -> str:
    """`jobspec ARGS` in a fresh process with an empty cache (unless `cache` names one used
    before); asserts it succeeded and (unless `verbose`) printed nothing of a library's; returns
    stdout and stderr."""
    env = {**os.environ, "JOBSPEC_CACHE_DIR": str(tmp / "caches" / cache),
           "JOBSPEC_LOG_DIR": str(tmp / "logs"), "JOBSPEC_PROGRESS": "lines"}
    done = subprocess.run([sys.executable, "-m", "jobspec", *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    terminal = done.stdout + done.stderr
    assert done.returncode == 0, terminal[-4000:]
    if not verbose:
        assert library_lines(terminal) == [], f"jobspec {' '.join(args)}:\n{terminal[-4000:]}"
    return terminal


@pytest.fixture(scope="module")
def quiet_job(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("quiet")
    return tmp, write_quiet_job(tmp)


@pytest.mark.parametrize("command", [
    ["validate"], ["compile", "--out", "compiled"], ["plan"], ["launch", "--dry-run"],
    ["prepare", "--data-only"], ["sbatch"], ["schema"],
])
def test_each_command_run_cold_leaves_the_terminal_to_jobspec(quiet_job, command):
    tmp, job = quiet_job
    name, *flags = command
    run_cold(tmp, name, *([] if name == "schema" else [str(job)]), *flags, cache=f"cold-{name}")
    if name == "launch":   # what the planner's trace said is kept in the command's log
        assert "is_gradient_checkpointing" in (tmp / "logs" / "launch.log").read_text()


def test_verbose_shows_what_the_quiet_terminal_leaves_out(quiet_job):
    tmp, job = quiet_job
    terminal = run_cold(tmp, "plan", str(job), "--verbose", cache="verbose", verbose=True)
    assert library_lines(terminal)   # the patterns see it


@pytest.mark.slow
def test_a_real_launch_its_export_and_its_reports_leave_the_terminal_to_jobspec(quiet_job):
    tmp, job = quiet_job
    terminal = run_cold(tmp, "launch", str(job), cache="launch", timeout=900)
    assert "quiet finished: 2/2 steps" in terminal
    (run_dir,) = (tmp / "out").glob("run-*")
    run_cold(tmp, "sync", str(run_dir), cache="launch")
    checkpoints, exported = tmp / "out" / "checkpoints", tmp / "exported"
    run_cold(tmp, "export", str(checkpoints), "--out", str(exported), cache="launch")
    assert_export_layout(exported)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    run_cold(tmp, "report", "quiet", "--tracking-uri", uri, cache="launch")
    generations = run_cold(tmp, "report", "quiet", "--generations", "--tracking-uri", uri,
                           cache="launch")
    assert "prompt 1" in generations


def assert_export_layout(out: Path) -> None:
    """`--out DIR` holds all the export writes (the merged model, the adapter in DIR/adapter, with
    the tokenizer), every file with the mode the umask gives."""
    from transformers import AutoTokenizer
    assert not out.with_name(f"{out.name}-adapter").exists()
    assert (out / "config.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert AutoTokenizer.from_pretrained(out / "adapter").get_vocab() == \
        AutoTokenizer.from_pretrained(DATA / "tokenizer").get_vocab()
    from safetensors import safe_open
    with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as weights:
        names = list(weights.keys())
    assert names and all(".lora_" in name for name in names), names   # the adapters, not merged
    mask = os.umask(0)
    os.umask(mask)
    found = {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert found == {0o666 & ~mask}, sorted(oct(m) for m in found)
