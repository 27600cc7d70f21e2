"""A quiet terminal: which lines of the runner's and ranks' output `jobspec launch` shows.

launcher.log always gets every byte. The terminal gets jobspec's own lines, the progress bar or
lines, and every warning and error, but not the chatter of the libraries under it: DeepSpeed's
INFO/DEBUG log records (accelerator, world info, spawn commands), its warnings that say nothing
about the job ("Setting accelerator to CPU", no hostfile on a single node), torch's
extension-loading lines, MLflow's and alembic's INFO records, and jobspec's launcher.log-only lines
(jobspec/launcher_log.py). `--verbose` shows it all.

Output is relayed in chunks, so a line is held until its end is seen; a line that holds a carriage
return (the progress bar redrawing itself) is shown as it comes, and what another rank writes after
a redraw, on the same terminal line, is judged as a line of its own.
The launcher's own MLflow records (it creates the run, and its SQLite tables the first time) are
routed by `route_library_logs`.
"""
from __future__ import annotations

import logging
import re
import threading

from jobspec.launcher_log import LOG_ONLY

ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")
_DS_RECORD = rb"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] "
HIDDEN = [re.compile(p) for p in (
    _DS_RECORD + rb"\[(INFO|DEBUG)\] ",
    _DS_RECORD + rb"\[WARNING\] \[[^\]]*\] (Setting accelerator to CPU|Unable to find hostfile"
                 rb"|Attempting to get learning rate from scheduler before it has started)",
    rb"DeepSpeed \S+ built successfully$",   # deepspeed.comm prints it on every rank, cached or not
    rb"(Using \S+ as PyTorch extensions root|Emitting ninja build file|Building extension module"
    rb"|Allowing ninja to set a default number of workers|Loading extension module|ninja: no work "
    rb"to do"
    rb"|Time to load \S+ op:|Creating extension directory)",
    rb"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d INFO (mlflow|alembic)",
    rb"INFO  \[alembic",
    re.escape(LOG_ONLY.rstrip().encode()),   # lines are stripped: an empty log-only line too
)]


def hidden(line: bytes) -> bool:
    text = ANSI.sub(b"", line).strip()
    return any(pattern.match(text) for pattern in HIDDEN)


_MARKER = LOG_ONLY.strip().encode()
_TIMESTAMP = re.compile(_DS_RECORD)


def hidden_start(text: bytes, partial: bool = False) -> int:
    """Where another rank's hidden line begins after a bar redraw's last carriage return, on the
    same terminal line (the two writes arrived in one read); -1 if none does. A bar's own text never
    holds a log record's timestamp or jobspec's log-only marker, so searching there is safe. With
    `partial` (no newline yet), also where such a line may be starting: a record's timestamp, or the
    marker cut by the read ("...| 3/40jobspec-lo"), so that it is held until the rest comes."""
    after = text.rfind(b"\r") + 1
    patterns = [*HIDDEN, _TIMESTAMP] if partial else HIDDEN
    starts = [m.start() for m in (pattern.search(text, after) for pattern in patterns) if m]
    if partial:
        starts += [len(text) - size for size in range(1, min(len(_MARKER), len(text) - after + 1))
                   if text.endswith(_MARKER[:size])]
    return min(starts, default=-1)


class TerminalFilter:
    """Feed it the relayed chunks; it returns what the terminal should get."""

    def __init__(self):
        self._held = b""      # the start of a line not shown yet
        self._showing = False  # the current line's start was shown: show the rest as it comes

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        if self._showing and chunk[:1] not in (b"\r", b"\n"):
            # a bar redraw is one write: what follows it in a later write is another process's line
            self._showing = False
        while chunk:
            end = chunk.find(b"\n")
            if end < 0:
                if self._showing:
                    self._show_redraw(chunk, out)
                else:
                    self._held += chunk
                    if b"\r" in self._held:  # a progress bar redraw: never a library's log line
                        held, self._held = self._held, b""
                        self._show_redraw(held, out)
                break
            piece, chunk = chunk[:end + 1], chunk[end + 1:]
            line = piece if self._showing else self._held + piece
            self._held = b""
            if self._showing or not hidden(line):
                cut = hidden_start(line) if b"\r" in line else -1
                # a hidden line after a redraw takes its newline with it: the next redraw overwrites
                out.append(line if cut < 0 else line[:cut])
            self._showing = False
        return b"".join(out)

    def _show_redraw(self, text: bytes, out: list[bytes]) -> None:
        """Show a redraw now, all but a hidden line (or its possible start) written after it."""
        cut = hidden_start(text, partial=True)
        if cut < 0:
            out.append(text)
            self._showing = True
        else:
            out.append(text[:cut])
            self._held, self._showing = text[cut:], False

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return b"" if self._showing or not held or hidden(held) else held


def route_library_logs(log_path, verbose: bool, names=("mlflow", "alembic")) -> None:
    """MLflow's and alembic's records in the launcher process go to launcher.log, and to the
    terminal only from WARNING up (everything with --verbose). Call after `import mlflow`
    (tracking.run.import_mlflow), which installs its own stderr handler."""
    import sys

    to_file = logging.FileHandler(log_path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                           "%Y/%m/%d %H:%M:%S"))
    for name in names:
        logger = logging.getLogger(name)
        streams = [h for h in logger.handlers if type(h) is logging.StreamHandler]
        if not streams:  # alembic has none and would reach the root's "jobspec:" handler
            streams = [logging.StreamHandler(sys.stderr)]
            logger.addHandler(streams[0])
        for stream in streams:
            stream.setLevel(logging.NOTSET if verbose else max(stream.level, logging.WARNING))
        logger.addHandler(to_file)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


class HeldOutput:
    """The terminal (a binary stream) holding what the ranks print until `release()`, so that the
    header's MLflow lines, printed once the run exists (it is created while the ranks start), come
    before the ranks' first words. launcher.log gets everything as it comes."""

    def __init__(self, out):
        self._out, self._held, self._released = out, [], False
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._released:
                self._out.write(data)
            else:
                self._held.append(data)

    def flush(self) -> None:
        with self._lock:
            if self._released:
                self._out.flush()

    def release(self) -> None:
        with self._lock:
            if not self._released:
                self._released = True
                self._out.write(b"".join(self._held))
                self._held.clear()
                self._out.flush()
