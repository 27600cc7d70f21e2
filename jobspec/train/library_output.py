"""The ranks' part of the quiet terminal (jobspec/launch/quiet.py): what the libraries under a rank
print reaches launcher.log, not the terminal, and what the terminal does get comes once, from rank
0.

- Progress bars of transformers ("Loading weights", "Writing model shards"), datasets ("Generating
  train split") and huggingface_hub are off: set before those libraries are imported, they read it
  then. tqdm redraws in a relayed pipe are the one thing the launcher cannot hold back line by line.
- Log records of transformers (its LOAD REPORT table, once per rank), datasets and huggingface_hub
  (a download retried, every line twice: its own handler and the root's) are written as
  `jobspec-log: ` lines, which the launcher keeps for launcher.log; an ERROR from rank 0 stays on
  the terminal. A failure that matters reaches the user anyway, as the rank's exception.
- Python warnings: deprecations (FutureWarning, DeprecationWarning: about a library's use of
  another, e.g. ZeRO-3's torch.distributed calls) go to launcher.log only; any other warning is
  shown by rank 0 and logged by the others, so the terminal has one line per event, not one per
  rank.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings

from jobspec.launcher_log import LOG_ONLY

# read by huggingface_hub, transformers and datasets when they are imported
PROGRESS_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
# peft and bitsandbytes come in with transformers' model code (peft imports bitsandbytes, whose CPU
# backend warns about an optional kernels package on every import)
LIBRARY_LOGGERS = ("transformers", "datasets", "huggingface_hub", "peft", "bitsandbytes")
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
# warnings jobspec raises itself
JOBSPEC_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log_only(text: str, stream=None) -> None:
    """`text`, every line of it, for launcher.log only (one write: ranks share the pipe)."""
    stream = stream or sys.stderr
    stream.write("".join(f"{LOG_ONLY}{line}\n" for line in text.splitlines() or [""]))
    stream.flush()


class LogOnlyHandler(logging.Handler):
    """A library's records as launcher.log-only lines; ERROR and above from rank 0 as they are."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.levelno >= logging.ERROR and self.rank == 0:
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
            else:
                log_only(text)
        except Exception:  # noqa: BLE001 -- logging must never take the rank down
            self.handleError(record)


def before_imports(rank: int) -> None:
    """Call first in the rank, before transformers / datasets / huggingface_hub are imported."""
    for key, value in PROGRESS_ENV.items():
        os.environ.setdefault(key, value)

    def show(message, category, filename, lineno, file=None, line=None):
        if str(filename).startswith(JOBSPEC_PACKAGE):   # jobspec's own notice: one plain line
            text = f"jobspec: {message}"
            deprecation = False
        else:
            text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
            deprecation = issubclass(category, DEPRECATIONS)
        if deprecation or rank != 0:
            log_only(text)
        else:
            (file or sys.stderr).write(text + "\n")

    warnings.showwarning = show


def route_library_logs(rank: int, *, transformers: bool = True, datasets: bool = False) -> None:
    """The library loggers' own stderr handlers (and a LogOnlyHandler an earlier call installed,
    as a node launcher's preload does before forking the ranks) replaced by one LogOnlyHandler.
    Call once the rank is about to use them (each installs its handler when imported, so they are
    imported here)."""
    handler = LogOnlyHandler(rank)
    # installs transformers' and huggingface_hub's handlers (a lazy one: configured now)
    if transformers:
        from transformers.utils import logging as transformers_logging
        transformers_logging.get_logger("transformers")
        transformers_logging.disable_progress_bar()
    if datasets:   # (imported by name: datasets ships no type information)
        importlib.import_module("datasets.utils.logging").disable_progress_bar()
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, LogOnlyHandler)
                    or (isinstance(h, logging.StreamHandler)
                        and getattr(h, "stream", None) in (sys.stderr, sys.stdout))]:
            logger.removeHandler(old)
        if handler not in logger.handlers:
            logger.addHandler(handler)
        logger.propagate = False   # the root's "jobspec:" handler would print each record again
