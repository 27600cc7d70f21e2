"""The answers generated at evaluation (`training.eval_generate`) in MLflow: one table per run.

    eval_generations.json    MLflow's table format (`log_table`: pandas "split"), one row per prompt
                             and evaluation; columns step, user, reference, generation, system,
                             context, tokens, stop_reason, exact_match

`user` is the last user turn, the question the answer is to; it comes first, before the reference
and the answer, and the system prompt has a column of its own: a prompt shown whole starts with the
system prompt, which leaves no room for the question in a narrow column. `context` holds the turns
between them (a conversation's earlier turns), empty for a single question. MLflow lists the table
in the run's `mlflow.loggedArtifacts` tag and its Artifacts tab shows it as a table; the run's
description links to it (`description_line`, written by the launcher).

A step already in the table is not logged again: a resumed run evaluates a step again only when it
went back to a checkpoint before that evaluation, and then it trains to the same weights (MLflow's
`log_table` appends the rows it is given to the file). `jobspec report --generations` reads the
newest step of each run; `jobspec sync` uploads the steps an outage kept in generations.jsonl only.
Runs logged with one file per evaluation (eval_generations/step_<N, 8 digits>.json) are read too.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from jobspec import rundir

TABLE_FILE = "eval_generations.json"
COLUMNS = ("step", "user", "reference", "generation", "system", "context", "tokens", "stop_reason",
           "exact_match")
PER_STEP_DIR = "eval_generations"   # the older layout: one table per evaluation


def _download(client, run_id: str, path: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="jobspec-generations-") as tmp:
        local = client.download_artifacts(run_id, path, tmp)
        return json.loads(Path(local).read_text(encoding="utf-8"))


def _rows(table: dict) -> list[dict]:
    columns = table.get("columns", [])
    return [with_prompt(dict(zip(columns, row))) for row in table.get("data", [])]


def with_prompt(row: dict) -> dict:
    """`row` with its `prompt`: the conversation up to the question as one text (train/generation's
    shown_text), rebuilt from the columns where the table keeps them apart."""
    if row.get("prompt") is None:
        parts = ([f"system: {row['system']}"] if row.get("system") else []) + \
            ([row["context"]] if row.get("context") else [])
        question = row.get("user") or ""
        row["prompt"] = "\n".join([*parts, f"user: {question}"]) if parts else question
    return row


def _table_rows(client, run_id: str) -> list[dict]:
    """Every row of the run's table ([] without one)."""
    if TABLE_FILE not in {Path(info.path).name for info in client.list_artifacts(run_id)}:
        return []
    return _rows(_download(client, run_id, TABLE_FILE))


def _per_step_files(client, run_id: str) -> dict[int, str]:
    """The older layout's tables by step."""
    found = {}
    for info in client.list_artifacts(run_id, PER_STEP_DIR):
        name = Path(info.path).name
        if name.startswith("step_") and name.endswith(".json") and name[5:-5].isdigit():
            found[int(name[5:-5])] = f"{PER_STEP_DIR}/{name}"
    return found


def table_steps(client, run_id: str) -> list[int]:
    """The steps whose answers the run holds, in order."""
    steps = {int(row["step"]) for row in _table_rows(client, run_id)}
    return sorted(steps | set(_per_step_files(client, run_id)))


def _log(client, run_id: str, rows: list[dict]) -> None:
    table = {column: [table_value(row, column) for row in rows] for column in COLUMNS}
    client.log_table(run_id, data=table, artifact_file=TABLE_FILE)


def table_value(row: dict, column: str):
    """A row's cell; a row written before the prompt was split keeps its whole prompt as `user`."""
    if column == "user" and row.get("user") is None:
        return row.get("prompt")
    return row.get(column)


def log_table(client, run_id: str, step: int, rows: list[dict]) -> bool:
    """The rows of the evaluation at `step`; False (nothing logged) when the run holds them."""
    if int(step) in table_steps(client, run_id):
        return False
    _log(client, run_id, rows)
    return True


def read_table(client, run_id: str, step: int) -> list[dict]:
    """The rows of the run's evaluation at `step` (a dict per prompt, by column, with `prompt`)."""
    rows = [row for row in _table_rows(client, run_id) if int(row["step"]) == int(step)]
    per_step = _per_step_files(client, run_id)
    if not rows and int(step) in per_step:
        rows = _rows(_download(client, run_id, per_step[int(step)]))
    return rows


def latest_table(client, run_id: str) -> tuple[int, list[dict]] | None:
    """(step, rows) of the run's last evaluation with generations; None when it has none."""
    steps = table_steps(client, run_id)
    if not steps:
        return None
    return steps[-1], read_table(client, run_id, steps[-1])


def upload_missing(client, run_id: str, run_dir: Path) -> int:
    """The evaluations of generations.jsonl the run lacks (an outage kept them local): how many."""
    by_step: dict[int, list[dict]] = {}
    for row in rundir.read_generations(run_dir):
        by_step.setdefault(int(row["step"]), []).append(row)
    present = set(table_steps(client, run_id)) if by_step else set()
    missing = [step for step in sorted(by_step) if step not in present]
    if missing:
        _log(client, run_id, [row for step in missing for row in by_step[step]])
    return len(missing)


def description_line(experiment_id: str, run_id: str) -> str:
    """The run description's pointer to the table: a link within MLflow's UI (the run page's
    Artifacts tab with the table open) and the artifact's path."""
    link = f"#/experiments/{experiment_id}/runs/{run_id}/artifacts/{TABLE_FILE}"
    columns = ", ".join(COLUMNS[:5])
    return (f"**Evaluation generations**: [{TABLE_FILE}]({link}) (Artifacts tab, artifact "
            f"`{TABLE_FILE}`: a row per prompt and evaluation; columns {columns}, ...)")
