"""The logging section's cross-field rules: system metrics are recorded in the MLflow run, so a
written `system_metrics: true` needs MLflow on; and a tracking URI MLflow can open (scheme, slashes,
host)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from jobspec.errors import SpecIssue, did_you_mean

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec

URI_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# MLflow tracking stores; the database ones are SQLAlchemy URIs like sqlite:///.
TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "databricks", "databricks-uc",
                    "postgresql", "mysql", "mssql")


def system_metrics_issues(r: ResolvedSpec) -> list[SpecIssue]:
    s = r.spec
    # else its default: off with MLflow off (resolve_paths)
    written = ("logging", "system_metrics") in r.positions
    if written and s["logging"]["system_metrics"] and not s["logging"]["mlflow"]["enabled"]:
        return [r.issue(("logging", "system_metrics"),
                        "system metrics are recorded in the MLflow run, and MLflow "
                        "is off",
                        "set `logging.mlflow.enabled: true`, or `logging.system_metrics: false`, "
                        "its default with MLflow off", code="system-metrics-mlflow")]
    return []


def tracking_uri_issues(r: ResolvedSpec) -> list[SpecIssue]:
    problem = tracking_uri_problem(r.spec["logging"]["mlflow"]["tracking_uri"])
    return [r.issue(("logging", "mlflow", "tracking_uri"), *problem, code="tracking-uri")] \
        if problem else []


def tracking_uri_problem(uri: str) -> tuple[str, str] | None:
    """(message, hint) of a tracking URI MLflow could not open; None for a good one or a
    directory."""
    schemes = ", ".join(f"{s}:" for s in TRACKING_SCHEMES)
    if not uri.strip():
        return "empty tracking URI", ("use e.g. `sqlite:///mlflow.db`, `http://host:5000` or a "
                                      "directory")
    if uri in ("databricks", "databricks-uc"):
        return None
    match = URI_SCHEME.match(uri)
    if match is None or len(match.group(1)) == 1:   # no scheme (or a Windows drive): a directory
        return None
    scheme = match.group(1).lower().split("+")[0]
    if scheme not in TRACKING_SCHEMES:
        return (f"`{match.group(1)}:` is not a tracking URI scheme MLflow knows",
                did_you_mean(scheme, list(TRACKING_SCHEMES), "use one of", beside=6)
                + f" ({schemes} or a path)")
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        return "a SQLite tracking URI needs three slashes", ("e.g. `sqlite:///mlflow.db` (four for "
                                                             "an absolute path)")
    if scheme in ("http", "https") and not re.match(r"^https?://[^/\s]+", uri):
        return "an http(s) tracking URI needs a host", "e.g. `http://mlflow.example.com:5000`"
    return None
