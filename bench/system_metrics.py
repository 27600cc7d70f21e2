"""What `logging.system_metrics` (on by default) costs a training process.

    python -m bench.system_metrics                     # ~2.5 minutes
    python -m bench.system_metrics --blocks 3 --block-s 20 --stress-interval 0.5

Two measurements, in one process, against a local SQLite store (the default store; a server costs
the process less, its writes being the server's):

1. **Per sample**: jobspec's SystemMetrics (MLflow's monitor, as each node's local rank 0 runs it)
   sampling every `--stress-interval` seconds; the monitor thread's own CPU time (per-thread times
   from /proc, psutil) divided by the samples it took. Everything the monitor does runs in that
   thread: psutil/NVML readings, its per-sample `get_run` status check, the `log_batch` into the
   store. At MLflow's 10 s interval, the share of one core is that CPU time / 10 s.
2. **In a training loop**: a CPU-bound step (a small MLP's forward/backward/step, one OpenMP
   thread, ~20 ms) run in alternating blocks with the monitor off, on at the default 10 s, and on
   at the stress interval; the process's CPU time per step in each (all threads), so the monitor's
   share is measured where it lands, next to the noise of the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil


def thread_cpu_s(native_id: int) -> float:
    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    return 0.0


def monitor_thread(monitor) -> threading.Thread:
    thread = monitor._monitor._process
    assert thread is not None and thread.native_id is not None
    return thread


def start_monitor(run_dir: Path, interval: float):
    from jobspec.tracking import system
    system.SAMPLING_INTERVAL_S = interval
    started = system.SystemMetrics.start(run_dir, node_index=0, nodes=1)
    assert started is not None, "the monitor did not start"
    return started


def steps(model, optimizer, batch, n: int) -> tuple[float, float]:
    """(CPU s, wall s) of the whole process for n training steps."""
    import torch
    x, y = batch
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.process_time() - cpu0, time.perf_counter() - wall0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=3, help="repeats of (off, default, stress)")
    parser.add_argument("--block-s", type=float, default=15.0, help="seconds per block")
    parser.add_argument("--stress-interval", type=float, default=0.5, help="sampling interval of the stress side (s)")
    parser.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON here")
    args = parser.parse_args()

    os.environ.pop("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", None)   # the interval is set per side here
    import torch
    torch.set_num_threads(1)

    from jobspec import rundir
    from jobspec.tracking import run as tracking
    tmp = Path(tempfile.mkdtemp(prefix="jobspec-sysmetrics-"))
    client = tracking.client_for(f"sqlite:///{tmp / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("system-metrics-bench"))
    run_dir = tmp / "run"
    run_dir.mkdir()
    rundir.write_mlflow_run(run_dir, {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
                                      "experiment_id": run.info.experiment_id, "run_id": run.info.run_id})

    # 1. per sample, at the stress interval
    monitor = start_monitor(run_dir, args.stress_interval)
    thread = monitor_thread(monitor)
    cpu0, t0 = thread_cpu_s(thread.native_id), time.time()
    time.sleep(args.block_s * 2)
    cpu1, t1 = thread_cpu_s(thread.native_id), time.time()
    monitor.stop()
    samples = len(client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage"))
    per_sample_ms = (cpu1 - cpu0) * 1000 / max(1, (t1 - t0) / args.stress_interval)
    metric_names = sorted(k for k in client.get_run(run.info.run_id).data.metrics if k.startswith("system/"))

    # 2. in a training loop: off / default interval / stress interval, interleaved
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = (torch.randn(64, 512), torch.randint(0, 2, (64,)))
    steps(model, optimizer, batch, 20)   # warm-up
    cpu, wall = steps(model, optimizer, batch, 20)
    n = max(10, int(args.block_s / (wall / 20)))
    per_step: dict[str, list[float]] = {"off": [], "default (10 s)": [], f"stress ({args.stress_interval:g} s)": []}
    for _ in range(args.blocks):
        for side, interval in zip(per_step, (None, 10.0, args.stress_interval)):
            started = start_monitor(run_dir, interval) if interval else None
            cpu, wall = steps(model, optimizer, batch, n)
            if started is not None:
                started.stop()
            per_step[side].append(cpu * 1000 / n)
    off = statistics.median(per_step["off"])
    result = {
        "samples": samples, "stress_interval_s": args.stress_interval,
        "monitor_cpu_ms_per_sample": round(per_sample_ms, 2),
        "share_of_one_core_at_10s_percent": round(per_sample_ms / 10_000 * 100, 4),
        "metrics": metric_names,
        "steps_per_block": n,
        "cpu_ms_per_step": {side: [round(v, 2) for v in values] for side, values in per_step.items()},
        "cpu_per_step_vs_off_percent": {side: round((statistics.median(v) / off - 1) * 100, 2)
                                        for side, v in per_step.items() if side != "off"},
    }
    print(f"system metrics monitor: {per_sample_ms:.2f} ms of CPU per sample ({samples} samples at "
          f"{args.stress_interval:g} s); at MLflow's 10 s interval {result['share_of_one_core_at_10s_percent']}% "
          f"of one core")
    print(f"metrics recorded: {', '.join(metric_names)}")
    for side, values in per_step.items():
        print(f"training step, monitor {side}: CPU ms/step median {statistics.median(values):.2f} "
              f"(blocks {', '.join(f'{v:.2f}' for v in values)})"
              + ("" if side == "off" else f", {result['cpu_per_step_vs_off_percent'][side]:+.2f}% vs off"))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
