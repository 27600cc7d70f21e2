"""Headless plots for `jobspec report`: per-run memory and throughput over steps, logged to the run
under `plots/`, and one comparison across runs (samples/s and peak memory per run, in the spirit of
the summary plot of the Hugging Face single-GPU guide).

matplotlib is used with the Agg backend (no display needed: CI, ssh, Slurm nodes).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

PLOTS_DIR = "plots"           # artifact folder of a run
RUN_PLOTS = ("memory.png", "throughput.png")
COMPARISON_FILE = "comparison.png"

MEMORY_LABELS = {
    "mem/peak_allocated_mib_max": "peak allocated (max over ranks)",
    "mem/peak_allocated_mib_rank0": "peak allocated (rank 0)",
    "mem/peak_reserved_mib_max": "peak reserved (max over ranks)",
    "mem/peak_reserved_mib_rank0": "peak reserved (rank 0)",
    "mem/nvml_used_mib_max": "NVML used (max over GPUs)",
    "mem/host_rss_mib_max": "host RSS (max over ranks)",
}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _xy(points):
    return [s for s, _ in points], [v for _, v in points]


def plot_memory(series: dict, path: Path, title: str = "") -> Path | None:
    """Every `mem/*` series over optimizer steps; None when the run logged no memory."""
    present = [name for name in MEMORY_LABELS if series.get(name)]
    if not present:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in present:
        ax.plot(*_xy(series[name]), marker="o", markersize=3, label=MEMORY_LABELS[name])
    ax.set_xlabel("optimizer step")
    _integer_steps(ax)
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"memory: {title}" if title else "memory")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_throughput(series: dict, path: Path, title: str = "") -> Path | None:
    """samples/s and tokens/s over optimizer steps (two panels: different scales)."""
    panels = [(name, label) for name, label in (("perf/samples_per_s", "samples/s"),
                                                ("perf/tokens_per_s", "tokens/s"))
              if series.get(name)]
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels) + 0.6), sharex=True,
                             squeeze=False)
    for ax, (name, label) in zip(axes[:, 0], panels):
        ax.plot(*_xy(series[name]), marker="o", markersize=3)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    _integer_steps(axes[-1, 0])
    axes[0, 0].set_title(f"throughput: {title}" if title else "throughput")
    return _save(fig, plt, path)


def plot_comparison(rows: list[dict], path: Path, title: str = "") -> Path | None:
    """Horizontal bars per run: steady-state samples/s, and peak memory (GPU allocated when
    measured, else host RSS: a CPU run has no GPU memory to show)."""
    if not rows:
        return None
    plt = _pyplot()
    names = [row["run"] for row in rows]
    gpu = any(row.get("peak_allocated_mib") is not None for row in rows)
    # the measured peak and its plan's column (report/table.PLAN_COLUMNS)
    memory_key, plan_key, memory_label = (
        ("peak_allocated_mib", "predicted_mib", "peak allocated (MiB)") if gpu
        else ("host_rss_mib", "host_plan_mib", "peak host RSS (MiB)"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.8), sharey=True)
    for ax, key, label, color in ((left, "samples_per_s", "samples/s (run average)", "tab:blue"),
                                  (right, memory_key, memory_label, "tab:orange")):
        values = [row.get(key) or 0.0 for row in rows]
        bars = ax.barh(range(len(rows)), values, color=color)
        for bar, row in zip(bars, rows):
            shown = "-" if row.get(key) is None else f"{row[key]:.1f}"
            ax.annotate(shown, (bar.get_width(), bar.get_y() + bar.get_height() / 2), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.margins(x=0.2)
        ax.grid(axis="x", alpha=0.3)
    if any(row.get(plan_key) for row in rows):
        ys = [i for i, row in enumerate(rows) if row.get(plan_key)]
        right.scatter([rows[i][plan_key] for i in ys], ys, marker="|", s=300, color="black",
                      label="planner prediction", zorder=3)
        right.legend(fontsize=8, loc="lower right")
    left.set_yticks(range(len(rows)), names, fontsize=8)
    left.invert_yaxis()  # first run on top, like the table
    fig.suptitle(title or "runs compared")
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_run_plots(client, run_id: str, series: dict, title: str = "") -> list[str]:
    """Draw and log `plots/memory.png` and `plots/throughput.png` to the run, unless it has them.

    Returns the artifact paths logged now (empty when they were already there or nothing was
    logged).
    """
    existing = {Path(a.path).name for a in client.list_artifacts(run_id, PLOTS_DIR)}
    if all(name in existing for name in RUN_PLOTS):
        return []
    logged = []
    with tempfile.TemporaryDirectory(prefix="jobspec-plots-") as tmp:
        makers = {"memory.png": plot_memory, "throughput.png": plot_throughput}
        for name in RUN_PLOTS:
            if name in existing:
                continue
            made = makers[name](series, Path(tmp) / name, title)
            if made is not None:
                client.log_artifact(run_id, str(made), artifact_path=PLOTS_DIR)
                logged.append(f"{PLOTS_DIR}/{name}")
    return logged
