"""The quiet terminal on every path: what the libraries under the ranks print (transformers' LOAD
REPORT and progress bars, datasets' "Generating train split", ZeRO-3's FutureWarnings, hub retries)
reaches launcher.log and not the terminal, and the progress bar and the closing block never
interleave. Unit tests of each piece, and one real launch under a pseudo-terminal (slow), which
also records system metrics by default."""
from __future__ import annotations

import io
import json
import logging
import os
import pty
import select
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from jobspec.launch import hub
from jobspec.launch.quiet import TerminalFilter
from jobspec.train import library_output
from jobspec.train.progress import Progress


def shown(stream: bytes) -> bytes:
    flt = TerminalFilter()
    return flt.feed(stream) + flt.flush()


def test_log_only_lines_reach_the_log_and_not_the_terminal():
    out = io.StringIO()
    library_output.log_only("Key | Status\n\nclassifier.bias | MISSING", stream=out)
    text = out.getvalue()
    assert text.count("jobspec-log:") == 3 and "MISSING" in text
    assert shown(text.encode()) == b""   # the empty line of a table too


def test_library_records_go_to_the_log_and_rank_0_errors_to_the_terminal(capfd):
    loggers = [logging.getLogger(name) for name in library_output.LIBRARY_LOGGERS]
    saved = [(list(lg.handlers), lg.propagate) for lg in loggers]
    logger = logging.getLogger("huggingface_hub")
    logger.addHandler(logging.StreamHandler(sys.stderr))   # as huggingface_hub installs its own
    try:
        library_output.route_library_logs(0, transformers=False)
        logger.warning("'[Errno -2]' thrown while requesting HEAD ...\nRetrying in 1s [Retry 1/5].")
        logger.error("the hub refused")
        err = capfd.readouterr().err
    finally:
        for lg, (handlers, propagate) in zip(loggers, saved):
            lg.handlers[:], lg.propagate = handlers, propagate
    assert err.count("thrown while requesting") == 1 and err.count("Retrying") == 1   # once, not twice
    assert shown(err.encode()).decode() == "[huggingface_hub] ERROR the hub refused\n"


@pytest.mark.parametrize("rank", [0, 1])
def test_deprecations_are_logged_and_other_warnings_shown_once_by_rank_0(rank, capfd, monkeypatch):
    saved = warnings.showwarning
    for key in library_output.PROGRESS_ENV:   # set by before_imports: restored after the test
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    try:
        library_output.before_imports(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning)
            warnings.warn("something worth reading", UserWarning)
        err = capfd.readouterr().err
    finally:
        warnings.showwarning = saved
    assert "all_gather_into_tensor" in err and "something worth reading" in err   # both in launcher.log
    terminal = shown(err.encode()).decode()
    assert "all_gather_into_tensor" not in terminal
    assert ("something worth reading" in terminal) == (rank == 0)
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_lines_after_the_last_step_come_below_a_closed_bar():
    stream = io.StringIO()
    progress = Progress(4, mode="bar", stream=stream)
    progress.update(2)
    progress.message("checkpoint step2 saved to /c")   # mid-run: tqdm clears, writes, redraws
    progress.update(4)
    progress.message("checkpoint step4 saved to /c")
    progress.message("model (final) exported to /m")
    progress.close()
    text = stream.getvalue()
    tail = text[text.index("checkpoint step4"):]
    assert tail == "checkpoint step4 saved to /c\nmodel (final) exported to /m\n"   # no bar redrawn around them
    assert "4/4" in text[:text.index("checkpoint step4")]


def test_an_unreachable_hub_means_the_cache_at_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "")   # what offline_if_unreachable sets is undone after the test
    if "huggingface_hub.constants" in sys.modules:
        constants = sys.modules["huggingface_hub.constants"]
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")   # nothing listens there
    spec = {"model": {"name_or_path": str(tmp_path)}, "data": {"tokenizer": None}}
    assert not hub.offline_if_unreachable(spec) and os.environ["HF_HUB_OFFLINE"] == ""   # no hub id: no probe
    spec["data"]["tokenizer"] = "bert-base-uncased"
    assert hub.offline_if_unreachable(spec) and os.environ["HF_HUB_OFFLINE"] == "1"
    assert "bert-base-uncased from the local Hugging Face cache only" in capsys.readouterr().out
    assert not hub.offline_if_unreachable(spec)   # the user's (or an earlier) offline mode stands


# --- the real thing ------------------------------------------------------------------------------

def run_in_pty(argv: list[str], cwd: Path, timeout_s: float = 600) -> tuple[int, bytes]:
    """Run `argv` with a pseudo-terminal as stdin/stdout/stderr: what a user at a terminal sees."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=follower, stdout=follower, stderr=follower, close_fds=True,
                            env={**os.environ, "COLUMNS": "100"})
    os.close(follower)
    out, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:   # the terminal's other end closed: every process that had it is gone
                break
            if not data:
                break
            out += data
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(timeout=30), out


def tiny_pretrained(tmp_path: Path) -> None:
    """A local 'pretrained' encoder without a classification head (transformers reports the new
    head in its LOAD REPORT), its tokenizer, and a jsonl data file (datasets generates a split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = ["cat", "mat", "dog", "log", "sun", "fun", "red", "bed", "big", "pig", "hot", "pot"]
    rows = [{"text": " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8)), "label": i % 2}
            for i in range(48)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([r["text"] for r in rows], trainers.WordPieceTrainer(vocab_size=60, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(s, tok.token_to_id(s)) for s in ("[CLS]", "[SEP]")])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                      cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(tmp_path / "base")
    wrapped.save_pretrained(tmp_path / "base")


@pytest.mark.slow
def test_a_real_launch_at_a_terminal_shows_no_library_output(tmp_path):
    tiny_pretrained(tmp_path)
    job = tmp_path / "quiet.yaml"
    job.write_text(yaml.safe_dump({
        "name": "quiet",
        "model": {"name_or_path": "base", "task": "sequence-classification", "num_labels": 2},
        "data": {"train": "train.jsonl", "eval": "train.jsonl", "max_length": 16, "num_workers": 0,
                 "pin_memory": False},
        "training": {"max_steps": 6, "micro_batch_size": 4, "eval_every": 3},
        "checkpoint": {"every_n_steps": 3},
        "memory": {"zero_stage": 3},
        "resources": {"gpus_per_node": 2},
        "logging": {"every_n_steps": 1, "progress": "auto",
                    "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}},
        "output_dir": "out",
    }, sort_keys=False))
    code, raw = run_in_pty([sys.executable, "-m", "jobspec", "launch", str(job)], tmp_path)
    terminal = raw.decode("utf-8", "replace")
    assert code == 0, terminal[-3000:]
    (run_dir,) = (tmp_path / "out").glob("run-*")
    log = (run_dir / "launcher.log").read_text()
    for leak in ("LOAD REPORT", "Loading weights", "Generating train split", "FutureWarning", "Writing model shards",
                 "jobspec-log", "[INFO]", "Retrying"):
        assert leak not in terminal, (leak, terminal[-3000:])
    for kept in ("LOAD REPORT", "FutureWarning"):   # the libraries' words are in launcher.log
        assert kept in log, kept
    from jobspec import rundir
    from jobspec.tracking import run as tracking
    info = rundir.read_mlflow_run(run_dir)   # system metrics are on by default (the last sample at the end)
    metrics = tracking.client_for(info["tracking_uri"]).get_run(info["run_id"]).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics)
    assert terminal.count("checkpoint step3 saved") == 1 and "eval=" in terminal   # a bar, with its postfix
    # the bar is closed before the last lines: no redraw around them, the closing block on lines of its own
    last = terminal[terminal.index("checkpoint step6 saved"):]
    assert "step/s" not in last and "\r" not in last.replace("\r\n", "\n"), last
    assert "\r\nmodel (final) exported to " in last and "\r\n\x1b[1mjobspec: quiet finished: 6/6 steps" in last
