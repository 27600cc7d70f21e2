"""The `export` section's cross-field rules (`best_eval` needs evaluation data, `best_metric`
against the task's metrics; rule code `export-best`), and the exported weights' dtype, which the
rank side and the launch's disk pre-flight both need.

Pure (the export package's part on the validate path: no torch, nothing above jobspec.spec):
`export_issues` is one of validation's `CROSS_FIELD_RULES`, on the defaults-filled spec.
"""
from __future__ import annotations

from jobspec.errors import did_you_mean
from jobspec.spec.types import JobSpec
from jobspec.tasks import metrics as eval_metrics

CODE = "export-best"   # the rule code of every rule below (`validate --format json`)


def resolve_dtype(spec: JobSpec, requested: str | None = None) -> str:
    """fp32 | bf16 | fp16: `requested` (CLI), else `export.dtype`, whose `auto` follows
    `memory.precision`."""
    choice = requested or spec["export"]["dtype"]
    if choice == "auto":
        return spec["memory"]["precision"]
    return choice


def export_issues(r) -> list:
    s = r.spec
    data = s["data"]
    has_eval = data["eval"] is not None or bool((data["synthetic"] or {}).get("eval_samples"))
    if s["export"]["best_eval"] and not has_eval:
        metric = s["export"]["best_metric"]
        best = "the lowest evaluation loss" if metric == "loss" else f"the best evaluation {metric}"
        return [r.issue(("export", "best_eval"), f"`best_eval` exports at {best}, but the job "
                        "has no evaluation data",
                        "set `data.eval` (or `data.synthetic.eval_samples`), or remove "
                        "`export.best_eval`", code=CODE)]
    return best_metric_issues(r)


def best_metric_issues(r) -> list:
    """`export.best_metric` must be a metric the job's task produces (jobspec.tasks.metrics),
    and mean something: `best_eval` on. Whether token labels are BIO tags is known only once the
    ranks have read the data (jobspec.export.exporter.check_best_metric); synthetic labels never
    are."""
    s = r.spec
    task, name = s["model"]["task"], s["export"]["best_metric"]
    where = ("export", "best_metric")
    produced = eval_metrics.metrics_of(task)
    if name not in produced:
        hint = did_you_mean(name, produced, f"the metrics of {task}", beside=len(produced))
        return [r.issue(where, f"`{name}` is not a metric of {task}", hint, code=CODE)]
    if (task, name) in eval_metrics.BIO_ONLY and s["data"]["synthetic"] is not None:
        return [r.issue(where,
                        f"`{name}` of {task} is the entity F1 of BIO tags, but synthetic data has "
                        "integer labels",
                        "use `best_metric: accuracy` (token accuracy) or `loss`, or train on "
                        "a file whose labels are BIO tags (O, B-PER, I-PER, ...)", code=CODE)]
    if name != "loss" and not s["export"]["best_eval"]:
        return [r.issue(where,
                        "`best_metric` picks the model `best_eval` exports, but `best_eval` is off",
                        "set `export.best_eval: true`, or remove `export.best_metric`", code=CODE)]
    return []
