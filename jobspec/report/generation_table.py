"""`jobspec report EXPERIMENT --generations`: each prompt with every run's latest answer side by
side.

Reads the rows of each run's newest evaluation in its `eval_generations.json` table
(training.eval_generate, tracking/generations.py). Prompts are matched by their text across runs (in
the order the first run that has them lists them), the reference shown once; a run that did not
answer a prompt shows '-'. Printed as text blocks; written with --out as generations.md (one
Markdown table, a column per run) and generations.html (the same table, texts escaped, line breaks
kept).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

MISSING = "-"


@dataclass
class Comparison:
    runs: list[str] = field(default_factory=list)              # column labels: run name (step N)
    prompts: list[str] = field(default_factory=list)
    references: dict[str, str | None] = field(default_factory=dict)
    # prompt -> run label -> answer
    answers: dict[str, dict[str, str]] = field(default_factory=dict)


def compare(tables: list[tuple[str, int, list[dict]]]) -> Comparison:
    """(run label, step, rows) per run, oldest run first -> the side-by-side comparison (pure)."""
    out = Comparison()
    for name, step, rows in tables:
        label = f"{name} (step {step})"
        out.runs.append(label)
        for row in rows:
            prompt = str(row.get("prompt") or "")
            if prompt not in out.answers:
                out.prompts.append(prompt)
                out.answers[prompt] = {}
                out.references[prompt] = row.get("reference")
            elif out.references[prompt] is None and row.get("reference") is not None:
                out.references[prompt] = row.get("reference")
            out.answers[prompt][label] = str(row.get("generation") or "")
    return out


def collect(client, reports) -> Comparison:
    """The comparison of the runs of `reports` (report/table.collect's RunReport list) that
    generated."""
    from jobspec.tracking import generations
    tables = []
    for item in reports:
        latest = generations.latest_table(client, item.run_id)
        if latest is not None:
            tables.append((item.row["run"], latest[0], latest[1]))
    return compare(tables)


def render_text(c: Comparison) -> str:
    width = max([len("reference"), *(len(r) for r in c.runs)])
    blocks = []
    for number, prompt in enumerate(c.prompts, 1):
        lines = [f"prompt {number}: " + _indent(prompt, 4)]
        if c.references[prompt] is not None:
            lines.append(f"  {'reference':<{width}}  "
                         + _indent(c.references[prompt] or "", width + 4))
        for run in c.runs:
            lines.append(f"  {run:<{width}}  "
                         + _indent(c.answers[prompt].get(run, MISSING), width + 4))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def render_markdown(c: Comparison) -> str:
    headers = ["prompt", "reference", *c.runs]
    lines = ["| " + " | ".join(_md(h) for h in headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    for prompt in c.prompts:
        cells = [prompt, c.references[prompt] or MISSING,
                 *(c.answers[prompt].get(r, MISSING) for r in c.runs)]
        lines.append("| " + " | ".join(_md(cell) for cell in cells) + " |")
    return "\n".join(lines)


def render_html(c: Comparison, title: str) -> str:
    def cell(text: str, tag: str = "td") -> str:
        return f"<{tag}>{html.escape(text)}</{tag}>"
    head = "".join(cell(h, "th") for h in ["prompt", "reference", *c.runs])
    body = "".join("<tr>" + cell(p) + cell(c.references[p] or MISSING)
                   + "".join(cell(c.answers[p].get(r, MISSING)) for r in c.runs) + "</tr>\n"
                   for p in c.prompts)
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}: "
            "generations</title><style>body{font-family:sans-serif}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:6px;vertical-align:top;white-space:pre-wrap;max-width:40em}"
            "th{background:#eee}</style>"
            f"</head><body><h1>{html.escape(title)}: "
            f"generations</h1>\n<table><tr>{head}</tr>\n{body}</table></body></html>\n")


def _indent(text: str, by: int) -> str:
    return text.replace("\n", "\n" + " " * by)


def _md(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", "<br>")
