"""jobspec's own notices are one plain line, never a Python warning with its source line: on the ranks
(train/library_output) and in plan/compile/export/report (library_log) alike (issue 36 item 4)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from jobspec import library_log
from jobspec.train import library_output

INSIDE = str(Path(library_output.__file__))   # a warning raised by jobspec's own code


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_says_jobspecs_warning_in_one_plain_line(rank, capfd, monkeypatch):
    saved = warnings.showwarning
    for key in library_output.PROGRESS_ENV:
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    try:
        library_output.before_imports(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn_explicit("the tokenizer has no EOS token", UserWarning, INSIDE, 57)
        err = capfd.readouterr().err
    finally:
        warnings.showwarning = saved
    assert "jobspec: the tokenizer has no EOS token" in err
    assert "UserWarning" not in err and "warnings.warn" not in err and ":57:" not in err
    if rank == 0:
        assert err == "jobspec: the tokenizer has no EOS token\n"


def test_a_read_only_command_logs_library_warnings_and_says_its_own(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JOBSPEC_LOG_DIR", str(tmp_path))
    with library_log.quiet("plan") as log:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn_explicit("is_gradient_checkpointing is deprecated", FutureWarning,
                                   "/site-packages/transformers/modeling_utils.py", 3312)
            warnings.warn_explicit("a notice of ours", UserWarning, INSIDE, 1)
    err = capsys.readouterr().err
    assert err == "jobspec: a notice of ours\n"
    assert "is_gradient_checkpointing is deprecated" in Path(log).read_text()
    with library_log.quiet("plan", verbose=True) as log:
        assert log is None   # --verbose: nothing routed
