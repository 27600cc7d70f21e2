"""`logging.system_metrics` (on by default with MLflow on): MLflow's own system-metrics monitor
(CPU, host memory, disk, network and, where NVML answers through nvidia-ml-py, a dependency, every
GPU's utilisation, memory and power) in the job's MLflow run: the UI's "System metrics" tab.

One monitor per node, in the node's local rank 0: the metrics describe the machine, not a rank. On
more than one node each node's names carry its index (`system/node1/cpu_utilization_percentage`);
a resumed run continues the system steps where the run left them. The monitor samples every
SAMPLING_INTERVAL_S in its own thread (MLflow's default; MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
overrides it) and stops when the rank ends, with one last sample. It costs ~10 ms of CPU per sample
against a SQLite store, 0.1 % of one core at 10 s (`python -m bench.system_metrics`,
docs/benchmarks.md). Without an MLflow run (an optional tracking server that never came) there is
nothing to record into: launcher.log says so, the launcher has already warned about the server. With
MLflow off the setting is off unless written, and a written `true` is refused by validation.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from jobspec import launcher_log, rundir
from jobspec.errors import first_line

log = logging.getLogger("jobspec.tracking")

SAMPLING_INTERVAL_S = 10.0
# `stop` waits this long for a monitor still starting (a slow tracking server)
START_TIMEOUT_S = 60.0


class SystemMetrics:
    """A monitor being started in the background; `stop` flushes its last samples (call it before
    the run is ended).

    Making MLflow's monitor (its client, psutil, an NVML probe) takes ~1.5 s of CPU (3 s wall at
    load average 5 on the 2-core machine), which local rank 0 would otherwise spend before its first
    step: a thread does it while training starts, and `stop` waits for it."""

    def __init__(self):
        self._monitor = None
        self._starting: threading.Thread | None = None

    @classmethod
    def start(cls, run_dir: Path, node_index: int, nodes: int) -> "SystemMetrics | None":
        info = rundir.read_mlflow_run(run_dir)
        if info is None:
            launcher_log.note("logging.system_metrics: no MLflow run to record system metrics into")
            return None
        metrics = cls()
        metrics._starting = threading.Thread(target=metrics._start, args=(info, node_index, nodes),
                                             name="jobspec-system-metrics-start", daemon=True)
        metrics._starting.start()
        return metrics

    def _start(self, info: dict, node_index: int, nodes: int) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            monitor = SystemMetricsMonitor(info["run_id"], sampling_interval=SAMPLING_INTERVAL_S,
                                           resume_logging=True, tracking_uri=info["tracking_uri"],
                                           node_id=f"node{node_index}" if nodes > 1 else None)
            monitor.start()
        except Exception as err:  # monitoring is an extra: never the reason a training run fails
            log.warning("logging.system_metrics: MLflow's monitor did not start: %s",
                        first_line(err))
            return
        self._monitor = monitor

    def stop(self) -> None:
        """Stop sampling, then record one last sample: MLflow's loop drops the one it was taking, so
        a run shorter than the interval would otherwise have none."""
        if self._starting is not None:
            self._starting.join(timeout=START_TIMEOUT_S)
        monitor = self._monitor
        if monitor is None:   # it never started (warned), or is still starting after the timeout
            return
        try:
            monitor.finish()
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as err:
            log.warning("logging.system_metrics: stopping MLflow's monitor failed: %s",
                        first_line(err))
