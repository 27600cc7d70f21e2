"""The answers generated at evaluation (`training.eval_generate`) in MLflow: one table per evaluation.

    eval_generations/step_<N, 8 digits>.json    MLflow's table format (`log_table`: pandas "split")
                                                columns step, prompt, reference, generation, tokens,
                                                stop_reason, exact_match; one row per prompt

The run's artifact view shows each table (MLflow lists them in the run's `mlflow.loggedArtifacts`
tag), and the step in the file name keeps every evaluation's answers apart. A table that is already
there is left alone: a resumed run evaluates a step again only when it went back to a checkpoint
before that evaluation, and then it trains to the same weights, so the run keeps one table per step
(MLflow's `log_table` would append the rows a second time). `jobspec report --generations` reads the
newest table of each run; `jobspec sync` uploads the tables an outage kept in generations.jsonl only.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from jobspec import rundir

TABLE_DIR = "eval_generations"
COLUMNS = ("step", "prompt", "reference", "generation", "tokens", "stop_reason", "exact_match")


def table_file(step: int) -> str:
    return f"{TABLE_DIR}/step_{int(step):08d}.json"


def table_steps(client, run_id: str) -> list[int]:
    """The steps whose table the run holds, in order."""
    steps = []
    for info in client.list_artifacts(run_id, TABLE_DIR):
        name = Path(info.path).name
        if name.startswith("step_") and name.endswith(".json") and name[5:-5].isdigit():
            steps.append(int(name[5:-5]))
    return sorted(steps)


def log_table(client, run_id: str, step: int, rows: list[dict]) -> bool:
    """The table of the evaluation at `step`; False (nothing logged) when the run holds it already."""
    if int(step) in table_steps(client, run_id):
        return False
    client.log_table(run_id, data={column: [row.get(column) for row in rows] for column in COLUMNS},
                     artifact_file=table_file(step))
    return True


def read_table(client, run_id: str, step: int) -> list[dict]:
    """The rows of the run's table at `step` (one dict per prompt, by column)."""
    with tempfile.TemporaryDirectory(prefix="jobspec-generations-") as tmp:
        local = client.download_artifacts(run_id, table_file(step), tmp)
        table = json.loads(Path(local).read_text(encoding="utf-8"))
    columns = table.get("columns", [])
    return [dict(zip(columns, row)) for row in table.get("data", [])]


def latest_table(client, run_id: str) -> tuple[int, list[dict]] | None:
    """(step, rows) of the run's last evaluation with generations; None when it has none."""
    steps = table_steps(client, run_id)
    if not steps:
        return None
    return steps[-1], read_table(client, run_id, steps[-1])


def upload_missing(client, run_id: str, run_dir: Path) -> int:
    """The tables of generations.jsonl that the run lacks (an outage kept them local): how many uploaded."""
    by_step: dict[int, list[dict]] = {}
    for row in rundir.read_generations(run_dir):
        by_step.setdefault(int(row["step"]), []).append(row)
    present = set(table_steps(client, run_id)) if by_step else set()
    uploaded = 0
    for step, rows in sorted(by_step.items()):
        if step not in present:
            client.log_table(run_id, data={column: [row.get(column) for row in rows] for column in COLUMNS},
                             artifact_file=table_file(step))
            uploaded += 1
    return uploaded
