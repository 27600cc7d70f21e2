"""The trackers a spec can enable (`logging.<name>.enabled`): one module each, registered here.

Each module declares a `TRACKER` (the protocol of jobspec/tracking/base.py): what the launcher does
when the run starts and ends, and rank 0's MetricWriter that the metrics sink feeds after
metrics.jsonl. The launcher (launch/tracking.py) and the sink (tracking/sink.py) read them from
`TRACKERS`; a test keeps the keys equal to the schema's tracker sections, the objects of `logging`
with an `enabled` switch (tests/test_registries.py). Adding one: its `logging.<name>` section in the
schema, one module here, one line below (docs/architecture.md, "Adding a tracker").

Light: no tracker's library at import (each imports its own where it is enabled).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobspec.spec.types import JobSpec
from jobspec.tracking import mlflow_tracker, tensorboard
from jobspec.tracking.base import Tracker

# the tracker a run directory without a resolved spec still has (mlflow_run.json)
DEFAULT = "mlflow"

TRACKERS: dict[str, Tracker] = {t.name: t for t in (
    mlflow_tracker.TRACKER,
    tensorboard.TRACKER,
)}


def enabled(spec: JobSpec) -> list[Tracker]:
    """The trackers the (defaults-filled) spec switches on, in registry order."""
    # a tracker's name is its logging section (test_registries)
    sections: Mapping[str, Any] = spec["logging"]
    return [tracker for name, tracker in TRACKERS.items() if sections[name]["enabled"]]
