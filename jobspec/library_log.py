"""What the libraries print in any command's own process: kept in a log file, off the terminal
(`--verbose` shows it), as `jobspec launch` keeps its ranks' in launcher.log (launch/quiet.py,
train/library_output.py). `launch`'s own process (its checks, the planner's trace, bitsandbytes'
import) logs here too; its MLflow records go to the run's launcher.log
(launch/quiet.route_library_logs).

transformers' deprecation notices (`is_gradient_checkpointing is deprecated`), its config warnings
(`eos_token_id must be ...`), huggingface_hub's retries, datasets' and the hub's progress bars and
Python warnings with their source lines are the libraries' business: the command's own output is its
table or its error. A warning raised from jobspec's own code is one plain `jobspec: ...` line.
The log is ~/.cache/jobspec/logs/<command>.log (JOBSPEC_LOG_DIR), rewritten by each run.

Neutral ground (like launcher_log.py): cli.py wraps those commands in it. It imports transformers'
logging module (no torch), so that transformers' own stderr handler exists to be replaced, for
`export` and `report` (EAGER_COMMANDS); the others do not: `validate` imports no torch, and a warm
`plan` or `launch` (memory/plan_cache) neither torch nor transformers. While the block runs, a
handler a library adds to its logger is dropped (`_dropped`): transformers' stderr handler,
installed when a check or the planner's trace first imports it, and DeepSpeed's stdout handler,
which would print "Setting accelerator to CPU" into `plan`'s output when the trace of a tiled job
imports DeepSpeed.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator

QUIET_COMMANDS = ("validate", "compile", "schema", "launch", "plan", "prepare", "sbatch", "report",
                  "sync", "export")
# transformers is imported by what needs it, not up front (validate imports no torch; a warm plan or
# launch neither)
EAGER_COMMANDS = ("export", "report")
LOGGERS = ("transformers", "datasets", "huggingface_hub", "peft", "bitsandbytes", "torch",
           "deepspeed", "accelerate", "DeepSpeed")
PROGRESS_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
                "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}   # report --generations' downloads
JOBSPEC_PACKAGE = str(Path(__file__).resolve().parent)


def log_path(command: str) -> Path:
    base = os.environ.get("JOBSPEC_LOG_DIR") \
        or os.path.join(os.path.expanduser("~"), ".cache", "jobspec", "logs")
    return Path(base) / f"{command}.log"


@contextlib.contextmanager
def quiet(command: str, verbose: bool = False) -> Iterator[Path | None]:
    """Library log records and warnings to the command's log while the block runs (nothing when
    `verbose`); yields the log's path. Restores every logger and the warning hook afterwards."""
    if verbose or command not in QUIET_COMMANDS:
        yield None
        return
    path = log_path(command)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = open(path, "w", encoding="utf-8")
    except OSError:   # no writable cache: the records are dropped rather than shown
        stream = open(os.devnull, "w", encoding="utf-8")
    saved_env = {key: os.environ.get(key) for key in PROGRESS_ENV}
    for key, value in PROGRESS_ENV.items():
        os.environ.setdefault(key, value)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
    global _active
    _active = handler
    if command in EAGER_COMMANDS or "transformers" in sys.modules:
        _configure_transformers_logging()
    saved = {}
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.propagate)
        logger.handlers = [handler]
        logger.propagate = False
        setattr(logger, "addHandler", _dropped)   # a library's own, added when it is imported
    show = warnings.showwarning
    warnings.showwarning = _to_log(stream)
    try:
        yield path
    finally:
        _active = None
        warnings.showwarning = show
        for logger_name, (handlers, propagate) in saved.items():
            logger = logging.getLogger(logger_name)
            logger.__dict__.pop("addHandler", None)
            logger.handlers, logger.propagate = handlers, propagate
        for key, before in saved_env.items():
            if before is None:
                os.environ.pop(key, None)
        handler.close()
        stream.close()


_active: logging.Handler | None = None   # the running quiet block's handler


def _dropped(handler: logging.Handler) -> None:
    """A quiet block's library loggers' addHandler: their records go to the block's log only."""


def adopt_transformers() -> None:
    """Call where a command is about to import transformers (job/checks): inside a quiet block, its
    stderr handler (installed on import) is replaced by the block's log; outside one, nothing."""
    if _active is None:
        return
    _configure_transformers_logging()
    logger = logging.getLogger("transformers")
    logger.handlers, logger.propagate = [_active], False


def _configure_transformers_logging() -> None:
    """transformers installs its stderr handler on its first log call: have it installed now, to be
    replaced."""
    try:
        from transformers.utils import logging as transformers_logging
        transformers_logging.get_logger("transformers")
    except Exception:  # noqa: BLE001 - transformers missing or broken: nothing to route
        pass


def _to_log(stream):
    def show(message, category, filename, lineno, file=None, line=None):
        if str(filename).startswith(JOBSPEC_PACKAGE):   # jobspec's own notice: one plain line
            print(f"jobspec: {message}", file=sys.stderr)
            return
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        stream.flush()
    return show
