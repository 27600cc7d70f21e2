"""`logging.system_metrics: true`: MLflow's own system-metrics monitor (CPU, host memory, disk, network
and, where NVML answers, every GPU's utilisation, memory and power) in the job's MLflow run.

One monitor per node, in the node's local rank 0: the metrics describe the machine, not a rank. On
more than one node each node's names carry its index (`system/node1/cpu_utilization_percentage`);
a resumed run continues the system steps where the run left them. The monitor samples every
SAMPLING_INTERVAL_S in its own thread (MLflow's default; MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
overrides it) and stops when the rank ends, with one last sample. Without an MLflow run (the
tracking server never came) there is nothing to record into, and the rank says so once;
validation already refuses `system_metrics` with MLflow off.
"""
from __future__ import annotations

import logging
from pathlib import Path

from jobspec import rundir
from jobspec.errors import first_line

log = logging.getLogger("jobspec.tracking")

SAMPLING_INTERVAL_S = 10.0


class SystemMetrics:
    """A started monitor; `stop` flushes its last samples (call it before the run is ended)."""

    def __init__(self, monitor):
        self._monitor = monitor

    @classmethod
    def start(cls, run_dir: Path, node_index: int, nodes: int) -> "SystemMetrics | None":
        info = rundir.read_mlflow_run(run_dir)
        if info is None:
            log.warning("logging.system_metrics: no MLflow run to record system metrics into")
            return None
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            monitor = SystemMetricsMonitor(info["run_id"], sampling_interval=SAMPLING_INTERVAL_S,
                                           resume_logging=True, tracking_uri=info["tracking_uri"],
                                           node_id=f"node{node_index}" if nodes > 1 else None)
            monitor.start()
        except Exception as err:  # monitoring is an extra: never the reason a training run fails
            log.warning("logging.system_metrics: MLflow's monitor did not start: %s", first_line(err))
            return None
        return cls(monitor)

    def stop(self) -> None:
        """Stop sampling, then record one last sample: MLflow's loop drops the one it was taking, so a
        run shorter than the interval would otherwise have none."""
        monitor = self._monitor
        try:
            monitor.finish()
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as err:
            log.warning("logging.system_metrics: stopping MLflow's monitor failed: %s", first_line(err))
