"""Load: N tiny jobs back to back, then 4 at once, against one real `mlflow server`; every metric checked.

    python -m bench.load                 # 20 back-to-back + 4 concurrent (the issue's numbers)
    python -m bench.load --runs 5 --work /tmp/load

CI runs the same check smaller (tests/tracking/test_outage.py: JOBSPEC_LOAD_RUNS back-to-back, default 2,
then JOBSPEC_LOAD_CONCURRENT at once, default 2).
Prints wall time per launch and whether each run is FINISHED with every metrics.jsonl point in MLflow.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "tracking")]  # the test helpers and the outage test's launch

from mlflow_server import MlflowServer  # noqa: E402
from test_outage import assert_every_point_recorded, launch_tiny  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="back-to-back launches (default 20)")
    parser.add_argument("--concurrent", type=int, default=4, help="launches at once (default 4)")
    parser.add_argument("--work", type=Path, default=None, help="work directory (default: a new temp dir)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="jobspec-load-"))
    work.mkdir(parents=True, exist_ok=True)
    server = MlflowServer(work).start()
    try:
        times, run_dirs = [], []
        for i in range(args.runs):
            started = time.perf_counter()
            run_dirs.append(launch_tiny(work, f"seq{i}", server.uri)[1])
            times.append(time.perf_counter() - started)
            print(f"back-to-back {i + 1}/{args.runs}: {times[-1]:.1f} s", flush=True)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrent) as pool:
            run_dirs += [rd for _, rd in pool.map(lambda i: launch_tiny(work, f"par{i}", server.uri),
                                                  range(args.concurrent))]
        concurrent_s = time.perf_counter() - started
        for run_dir in run_dirs:
            assert_every_point_recorded(run_dir)
        print(f"{args.runs} back-to-back: median {sorted(times)[len(times) // 2]:.1f} s per launch, "
              f"total {sum(times):.0f} s; {args.concurrent} concurrent: {concurrent_s:.0f} s; "
              f"all {len(run_dirs)} runs FINISHED with every metric point in MLflow")
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
