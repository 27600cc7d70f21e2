"""launcher_log: the `jobspec-log: phase` lines bench/startup.py reads, and a process's start time
precise enough to time start-up phases from (the launcher's and each rank's first mark)."""
from __future__ import annotations

import io
import subprocess
import sys
import time

from bench.startup import read_phases
from jobspec import launcher_log


def test_a_new_process_knows_when_it_started_to_a_fraction_of_a_second():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from jobspec import launcher_log as log; "
                                                "print(repr(log.process_start()))"],
                         capture_output=True, text=True, check=True).stdout
    after = time.time()
    started = float(out)
    # between the spawn and the end of the child (its interpreter and import took the rest)
    assert before - 0.05 <= started <= after, (before, started, after)
    assert started - before < 0.5


def test_phase_lines_are_what_bench_startup_reads():
    text = io.StringIO()
    launcher_log.phase("rank0", "model", at=12.5, cpu=3.25, stream=text)
    assert text.getvalue() == "jobspec-log: phase rank0 model 12.500 3.250\n"
    marks, cpu = read_phases(text.getvalue())
    assert marks == {"rank0/model": 12.5} and cpu == {"rank0/model": 3.25}
