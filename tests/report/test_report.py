"""`jobspec report`: rows from MLflow runs shaped like real ones (params/artifacts through
jobspec.tracking.run, metrics with the shared names), CSV/markdown/table output, plots logged as
artifacts only when asked, clean errors; and one real quickstart launch reported end to end (slow)."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT as REPO
from jobspec import rundir
from jobspec.report import table as report

from jobspec.tracking import run as tracking
from jobspec.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# step -> metrics; the first point is warm-up and must not count towards the steady state
CPU_METRICS = {
    5: {"perf/samples_per_s": 10.0, "perf/tokens_per_s": 640.0, "mem/host_rss_mib_max": 300.0, "train/loss": 0.7},
    10: {"perf/samples_per_s": 100.0, "perf/tokens_per_s": 6400.0, "mem/host_rss_mib_max": 350.0, "train/loss": 0.6},
    15: {"perf/samples_per_s": 120.0, "perf/tokens_per_s": 7680.0, "mem/host_rss_mib_max": 320.0, "train/loss": 0.5},
    20: {"perf/samples_per_s": 110.0, "perf/tokens_per_s": 7040.0, "mem/host_rss_mib_max": 330.0, "train/loss": 0.4},
}
GPU_METRICS = {
    1: {"perf/samples_per_s": 1.0, "perf/mfu": 0.01, "perf/tflops_per_device": 1.0,
        "mem/peak_allocated_mib_max": 9000.0, "mem/nvml_used_mib_max": 11000.0, "mem/host_rss_mib_max": 4000.0},
    2: {"perf/samples_per_s": 30.0, "perf/mfu": 0.40, "perf/tflops_per_device": 40.0,
        "mem/peak_allocated_mib_max": 9500.0, "mem/nvml_used_mib_max": 11800.0, "mem/host_rss_mib_max": 4100.0},
    3: {"perf/samples_per_s": 32.0, "perf/mfu": 0.42, "perf/tflops_per_device": 42.0,
        "mem/peak_allocated_mib_max": 9400.0, "mem/nvml_used_mib_max": 11700.0, "mem/host_rss_mib_max": 4050.0},
}


def make_run(tmp: Path, name: str, uri: str, experiment: str, metrics: dict, overrides=(), status="FINISHED",
             extra_params=None) -> str:
    """A run as `jobspec launch` leaves it: compiled run dir, params/tags/artifacts, metrics, final status."""
    run_dir = tmp / name
    sets = [f"name={name}", f"output_dir={tmp / 'out'}", f"logging.mlflow.tracking_uri={uri}",
            f"logging.mlflow.experiment={experiment}", *overrides]
    assert main(["compile", str(REPO / "jobs" / "quickstart.yaml"), "--out", str(run_dir),
                 *[x for s in sets for x in ("--set", s)]]) == 0
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    launch = json.loads((run_dir / "launch.json").read_text())
    tracked = tracking.start_run(spec, launch, launch["derived"], (run_dir / "spec.yaml").read_text(), run_dir)
    from mlflow.entities import Metric, Param
    points = [Metric(k, v, 1000 + step, step) for step, values in metrics.items() for k, v in values.items()]
    tracked.client.log_batch(tracked.run_id, metrics=points,
                             params=[Param(k, str(v)) for k, v in (extra_params or {}).items()], synchronous=True)
    tracking.end_run(tracked, run_dir, status=status, exit_code=0 if status == "FINISHED" else 1)
    return tracked.run_id


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    ids = {
        "cpu-run": make_run(tmp, "cpu-run", uri, "exp", CPU_METRICS),
        "gpu-ckpt": make_run(tmp, "gpu-ckpt", uri, "exp", GPU_METRICS,
                             overrides=["memory.activation_checkpointing=true", "training.micro_batch_size=4",
                                        "training.global_batch_size=16", "memory.zero_stage=2"],
                             extra_params={"plan.peak_allocated_mib": 9876.5}),
        "broken": make_run(tmp, "broken", uri, "exp", {}, status="FAILED"),
    }
    return {"tmp": tmp, "uri": uri, "ids": ids}


def run_report(capsys, exp, *extra) -> tuple[int, str, str]:
    code = main(["report", "exp", "--tracking-uri", exp["uri"], *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_csv_rows_hold_the_settings_steady_throughput_and_peaks(experiment, capsys, tmp_path):
    code, out, _ = run_report(capsys, experiment, "--format", "csv", "--no-plots")
    assert code == 0
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(out))}
    assert list(rows) == ["cpu-run", "gpu-ckpt", "broken"]  # oldest first

    cpu = rows["cpu-run"]
    assert (cpu["status"], cpu["precision"], cpu["zero"], cpu["micro"], cpu["global"], cpu["accum"],
            cpu["checkpointing"], cpu["optimizer"], cpu["world"]) == \
        ("FINISHED", "fp32", "0", "16", "32", "1", "off", "adamw", "2")
    assert float(cpu["samples_per_s"]) == 110.0          # median of 100, 120, 110 (warm-up 10 left out)
    assert float(cpu["tokens_per_s"]) == 7040.0
    assert float(cpu["host_rss_mib"]) == 350.0           # max of the series
    assert cpu["mfu"] == cpu["peak_allocated_mib"] == cpu["nvml_used_mib"] == ""  # absent on CPU, not 0
    assert float(cpu["train_loss"]) == 0.4 and cpu["eval_loss"] == ""   # the last point; no evaluation
    assert "accuracy" not in cpu and "perplexity" not in cpu             # no run has a task metric
    spec = yaml.safe_load((experiment["tmp"] / "cpu-run" / "resolved.yaml").read_text())
    # no plan.* params (a launcher that logged none): the plan recomputed, on CPU ranks as it
    # measured no GPU, whose one figure is host RAM beside the RSS; the same float, through the CSV
    planned = report.planned_of_spec(spec, cpu_ranks=True)
    assert list(planned) == ["mem/host_rss_mib_max"]
    assert float(cpu["host_plan_mib"]) == planned["mem/host_rss_mib_max"]
    assert cpu["predicted_mib"] == ""

    gpu = rows["gpu-ckpt"]
    assert (gpu["zero"], gpu["micro"], gpu["global"], gpu["accum"], gpu["checkpointing"]) == ("2", "4", "16", "2", "all")
    assert float(gpu["samples_per_s"]) == 31.0 and float(gpu["mfu"]) == pytest.approx(0.41)
    assert float(gpu["peak_allocated_mib"]) == 9500.0 and float(gpu["nvml_used_mib"]) == 11800.0
    assert float(gpu["predicted_mib"]) == 9876.5          # the logged plan.* param wins
    assert gpu["gpu_total_plan_mib"] == gpu["host_plan_mib"] == ""   # nothing else recomputed

    broken = rows["broken"]
    assert broken["status"] == "FAILED" and broken["samples_per_s"] == "" and broken["host_rss_mib"] == ""


def test_table_and_markdown_are_aligned_and_show_missing_as_dash(experiment, capsys, tmp_path):
    code, out, _ = run_report(capsys, experiment, "--no-plots")
    assert code == 0
    lines = out.rstrip("\n").splitlines()
    assert len(lines) == 2 + 3 and lines[0].split()[:2] == ["run", "status"]
    header = lines[0]
    for line in lines[2:]:  # right-aligned numbers end where their header ends
        end = header.index("samples/s") + len("samples/s")
        assert line[end - 1] != " " and (len(line) == end or line[end] == " ")
    cpu_line = next(line for line in lines if line.startswith("cpu-run"))
    assert " 110.00 " in cpu_line and "  -  " in cpu_line

    code, out, _ = run_report(capsys, experiment, "--format", "markdown", "--no-plots", "--out", str(tmp_path))
    assert code == 0
    md = out.strip().splitlines()
    assert md[1].startswith("| --- | --- |") and len(md) == 5
    assert all(line.count("|") == md[0].count("|") for line in md)
    assert (tmp_path / "report.md").read_text() == out


def test_a_report_without_out_or_log_to_runs_writes_nothing(experiment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    client = tracking.client_for(experiment["uri"])
    artifacts = {run_id: {a.path for a in client.list_artifacts(run_id)} for run_id in experiment["ids"].values()}
    code, out, err = run_report(capsys, experiment)
    assert code == 0 and "cpu-run" in out, err
    assert list(tmp_path.iterdir()) == []   # no reports/ in the current directory
    assert {run_id: {a.path for a in client.list_artifacts(run_id)} for run_id in artifacts} == artifacts


def test_plots_are_pngs_logged_once_per_run(experiment, capsys, tmp_path):
    out_dir = tmp_path / "rep"
    code, _, err = run_report(capsys, experiment, "--out", str(out_dir), "--log-to-runs")
    assert code == 0, err
    comparison = out_dir / "comparison.png"
    assert comparison.read_bytes()[:8] == PNG_MAGIC and comparison.stat().st_size > 5000
    client = tracking.client_for(experiment["uri"])
    for name in ("cpu-run", "gpu-ckpt"):
        run_id = experiment["ids"][name]
        paths = {a.path for a in client.list_artifacts(run_id, "plots")}
        assert paths == {"plots/memory.png", "plots/throughput.png"}
        local = client.download_artifacts(run_id, "plots/memory.png", str(tmp_path))
        assert Path(local).read_bytes()[:8] == PNG_MAGIC
    assert client.list_artifacts(experiment["ids"]["broken"], "plots") == []  # nothing to draw
    # a second report leaves the logged plots alone
    from jobspec.report import plots
    assert plots.log_run_plots(client, experiment["ids"]["cpu-run"], {"perf/samples_per_s": [(1, 1.0)]}) == []


def test_unknown_experiment_is_a_clean_exit_2(experiment, capsys):
    code = main(["report", "nope", "--tracking-uri", experiment["uri"]])
    err = capsys.readouterr().err
    assert code == 2 and "no experiment or job named 'nope'" in err and "exp" in err and "Traceback" not in err


def test_a_job_name_finds_that_jobs_runs_in_any_experiment(experiment, capsys):
    # the runs were logged to experiment "exp"; each is tagged with its job's name (jobspec.job)
    assert main(["report", "gpu-ckpt", "--tracking-uri", experiment["uri"], "--format", "csv", "--no-plots"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["run"] for r in rows] == ["gpu-ckpt"] and rows[0]["zero"] == "2"


def test_missing_database_and_unreachable_server_are_clean_exit_2(tmp_path, capsys):
    assert main(["report", "exp", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert "no MLflow database" in capsys.readouterr().err and not (tmp_path / "none.db").exists()
    assert main(["report", "exp", "--tracking-uri", "http://u:secret99@127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "unavailable" in err and "secret99" not in err and "Traceback" not in err


def test_rows_have_the_final_losses_and_only_the_task_metric_columns_present():
    series = {"train/loss": [(1, 0.9), (10, 0.6), (20, 0.4)], "eval/loss": [(10, 0.5), (20, 0.45)],
              "eval/accuracy": [(10, 0.7), (20, 0.8125)], "eval/f1": [(10, 0.6), (20, 0.75)]}
    row = report.build_row("cls", "FINISHED", {}, series, None)
    assert (row["train_loss"], row["eval_loss"], row["accuracy"], row["f1"], row["perplexity"]) == \
        (0.4, 0.45, 0.8125, 0.75, None)
    keys = [key for key, _, _ in report.columns([row])]
    assert "perplexity" not in keys
    assert keys.index("world") < keys.index("train_loss") < keys.index("eval_loss") < keys.index("accuracy") \
        < keys.index("f1") < keys.index("samples_per_s")
    lm = report.build_row("lm", "FINISHED", {}, {"eval/perplexity": [(5, 20.0), (10, 12.3456)]}, None)
    header, _, cls_line, lm_line = report.render_table([row, lm]).splitlines()
    assert header.split()[header.split().index("world") + 1:][:7] == \
        ["train", "loss", "eval", "loss", "accuracy", "F1", "perplexity"]
    assert " 0.4000 " in cls_line and " 0.8125 " in cls_line
    assert " 12.35 " in lm_line
    rows = list(csv.DictReader(io.StringIO(report.render_csv([row, lm]))))
    assert rows[0]["accuracy"] == "0.8125" and rows[0]["perplexity"] == "" and rows[1]["perplexity"] == "12.3456"


def test_the_start_up_is_a_column_in_seconds_and_each_phase_a_csv_column_of_its_own():
    # a resumed run: one start-up per launch, the last launch's shown
    series = {"startup/to_first_step_s": [(1, 30.5), (21, 12.25)],
              "startup/model_s": [(1, 9.0), (21, 4.5)], "startup/first_step_s": [(21, 0.25)]}
    row = report.build_row("lm", "FINISHED", {}, series, None)
    older = report.build_row("old", "FINISHED", {}, {}, None)   # logged before the start-up was
    assert (row["startup_s"], row["startup_model_s"]) == (12.25, 4.5)
    assert row["startup_first_step_s"] == 0.25
    header, _, line, old_line = report.render_table([row, older]).splitlines()
    assert "start-up s" in header and "startup_model" not in header
    at = header.index("start-up s") + len("start-up s")
    assert line[:at].endswith(" 12.2") and old_line[:at].endswith(" -")
    csv_rows = list(csv.DictReader(io.StringIO(report.render_csv([row, older]))))
    keys = list(csv_rows[0])
    assert keys[keys.index("startup_s"):][:3] == \
        ["startup_s", "startup_model_s", "startup_first_step_s"]
    assert csv_rows[0]["startup_model_s"] == "4.5" and csv_rows[1]["startup_model_s"] == ""
    assert "startup_s" in report.render_csv([older]).splitlines()[0]
    assert "startup_model_s" not in report.render_csv([older]).splitlines()[0]


def test_steady_state_and_checkpointing_labels():
    assert report.steady_state([(3, 5.0), (1, 100.0), (2, 7.0)]) == 6.0   # sorted by step, first dropped
    assert report.steady_state([(1, 4.0)]) == 4.0
    assert report.steady_state([]) is None
    assert report._checkpointing({"memory.activation_checkpointing.every_n_layers": "3"}) == "1/3"
    assert report._checkpointing({"memory.activation_checkpointing": "true"}) == "all"
    assert report.predicted_peak_mib({"model": {"architecture": "no-such-model"}}) is None


def test_a_column_for_each_spec_field_that_differs_the_parameter_counts_and_the_plan_beside_the_peak():
    lora8 = {"model.lora.r": "8", "model.lora.alpha": "16", "name": "lora-8", "output_dir": "/runs/a",
             "memory.zero_stage": "0", "logging.every_n_steps": "5", "checkpoint.dir": "/runs/a/ckpt",
             "derived.total_steps": "40", "params.trainable": "1024", "params.total": "65536"}
    lora16 = {**lora8, "model.lora.r": "16", "name": "lora-16", "output_dir": "/runs/b", "memory.zero_stage": "2",
              "logging.every_n_steps": "1", "checkpoint.dir": "/runs/b/ckpt", "params.trainable": "2048"}
    series = {"mem/peak_allocated_mib_max": [(5, 38.0), (10, 40.5)]}
    plan = "mem/peak_allocated_mib_max"
    rows = [report.build_row("lora-8", "FINISHED", lora8, series, {plan: 42.0}),
            report.build_row("lora-16", "KILLED (preempted)", lora16, series, {plan: 44.0})]
    # model.lora.r only: zero has its own column; names, places, logging and derived numbers are not settings
    assert report.add_differing_fields(rows, [lora8, lora16]) == ["model.lora.r"]
    keys = [key for key, _, _ in report.columns(rows)]
    assert keys[:3] == ["run", "status", "spec.model.lora.r"]
    assert keys.index("world") < keys.index("trainable") < keys.index("parameters") < keys.index("train_loss")
    assert keys.index("predicted_mib") == keys.index("peak_allocated_mib") + 1
    assert rows[0]["predicted_mib"] == 42.0
    header, _, first, second = report.render_table(rows).splitlines()
    assert header.split()[:3] == ["run", "status", "model.lora.r"]
    assert "peak alloc MiB  plan alloc MiB" in header
    assert second.split()[:4] == ["lora-16", "KILLED", "(preempted)", "16"]
    assert " 2,048 " in second and " 65,536 " in second and " 1,024 " in first
    assert report.differing_fields([lora8]) == []   # one run: nothing differs


def test_the_reported_throughput_is_the_runs_average_and_older_runs_fall_back_to_the_series():
    series = {"perf/samples_per_s": [(5, 10.0), (10, 100.0), (15, 120.0)], "perf/run_samples_per_s": [(15, 97.25)]}
    assert report.build_row("r", "FINISHED", {}, series, None)["samples_per_s"] == 97.25
    del series["perf/run_samples_per_s"]   # logged before perf/run_* existed: the steady state
    assert report.build_row("r", "FINISHED", {}, series, None)["samples_per_s"] == 110.0


def assert_one_memory_figure(terminal: str, run_dir: Path, uri: str, row: dict) -> None:
    """CPU ranks: one planned figure, host RAM (the process and the tensors), the same MiB in the
    header, the closing block, summary.json, the MLflow params and the report, beside the RSS."""
    from jobspec.units import fmt_mib_gib
    plan = json.loads((run_dir / rundir.LAUNCH).read_text())["plan"]
    host = plan["host_total_mib"]
    assert "nvml_total_mib" not in plan and "peak_allocated_mib" not in plan   # no GPU figure
    assert host >= plan["host_runtime_mib"] + plan["host_tensors_mib"] > plan["host_runtime_mib"]
    shown = fmt_mib_gib(host * 2**20)
    assert f"host RAM    plan {shown} per rank (the process and its tensors: " in terminal
    summary = json.loads((run_dir / rundir.SUMMARY).read_text())
    rss = summary["peak_memory"]["mem/host_rss_mib_max"]
    assert f"host RAM    peak RSS {fmt_mib_gib(rss * 2**20)} (plan {shown}) per rank" in terminal
    assert "\n  memory " not in terminal and "per GPU" not in terminal
    assert summary["planned_memory"] == {"mem/host_rss_mib_max": host}
    tracked = json.loads((run_dir / "mlflow_run.json").read_text())
    params = tracking.client_for(uri).get_run(tracked["run_id"]).data.params
    assert params["plan.host_total_mib"] == f"{host:.1f}" and "plan.nvml_total_mib" not in params
    assert float(row["host_plan_mib"]) == host and float(row["host_rss_mib"]) == rss
    assert row["predicted_mib"] == row["gpu_total_plan_mib"] == ""


@pytest.mark.slow
def test_report_of_a_real_quickstart_launch(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    launch = subprocess.run(
        [sys.executable, "-m", "jobspec", "launch", str(REPO / "jobs" / "quickstart.yaml"),
         "--set", f"output_dir={tmp_path / 'out'}", "--set", f"logging.mlflow.tracking_uri={uri}",
         "--set", "logging.mlflow.experiment=real", "--set", "logging.every_n_steps=2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "op-cache")})   # a fresh machine's empty cache
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    # the README's job compiles nothing: torch's fused AdamW, no shm all-reduce op (issue 22)
    assert not (tmp_path / "op-cache").exists() or not any((tmp_path / "op-cache").iterdir())
    assert "building DeepSpeed op" not in launch.stdout + launch.stderr
    # the quickstart visibly learns in its default steps: eval loss from about chance (ln 2) to < 0.3
    (run_dir,) = (tmp_path / "out").glob("run-*")
    evals = [(step, value) for key, value, _, step in rundir.read_metric_points(run_dir) if key == "eval/loss"]
    assert [step for step, _ in evals] == [10, 20, 30, 40], evals
    assert evals[0][1] > 0.5 and evals[-1][1] < 0.3, evals
    assert json.loads((run_dir / rundir.SUMMARY).read_text())["eval_loss"] == evals[-1][1]
    result = subprocess.run([sys.executable, "-m", "jobspec", "report", "real", "--tracking-uri", uri,
                             "--format", "csv", "--out", str(tmp_path / "rep")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    (row,) = list(csv.DictReader(io.StringIO(result.stdout)))
    assert (row["run"], row["status"], row["world"], row["micro"]) == ("quickstart", "FINISHED", "2", "16")
    assert float(row["samples_per_s"]) > 0 and float(row["host_rss_mib"]) > 0
    assert_one_memory_figure(launch.stdout, run_dir, uri, row)
    # one throughput (docs/architecture.md, "Throughput"): summary.json, MLflow's run average, the report and the closing
    # summary show the same number, exactly (one float, written and read back, never recomputed)
    summary = json.loads((run_dir / rundir.SUMMARY).read_text())
    tracked = json.loads((run_dir / "mlflow_run.json").read_text())
    history = tracking.client_for(uri).get_metric_history(tracked["run_id"], "perf/run_samples_per_s")
    assert [m.value for m in history] == [summary["samples_per_s"]] == [float(row["samples_per_s"])]
    tokens = tracking.client_for(uri).get_metric_history(tracked["run_id"], "perf/run_tokens_per_s")
    assert [m.value for m in tokens] == [summary["tokens_per_s"]] == [float(row["tokens_per_s"])]
    assert f"{summary['samples_per_s']:.1f} samples/s · {summary['tokens_per_s']:,.0f} tokens/s" in launch.stdout
    # and it is the training time's: samples after the first step over less than the launch's wall time
    trained = (40 - 1) * 32   # 40 steps of the global batch 32, the first left out
    assert trained / summary["samples_per_s"] < summary["elapsed_s"]
    assert row["peak_allocated_mib"] == "" and row["mfu"] == ""   # CPU ranks
    # the final losses, and the task metrics of the last evaluation (over both ranks' 32 samples each)
    assert float(row["eval_loss"]) == evals[-1][1] and float(row["train_loss"]) > 0
    accuracy = float(row["accuracy"])
    assert accuracy >= 0.75 and accuracy * 64 == round(accuracy * 64) and 0 < float(row["f1"]) <= 1
    assert "perplexity" not in row
    assert f"eval        accuracy {100 * accuracy:.1f}% · F1 " in launch.stdout   # the closing summary
    assert (tmp_path / "rep" / "comparison.png").read_bytes()[:8] == PNG_MAGIC
    assert_startup_shown_and_recorded(launch.stdout, summary, uri, tracked["run_id"], row)


def assert_startup_shown_and_recorded(terminal: str, summary: dict, uri: str, run_id: str,
                                      row: dict) -> None:
    """The start-up's phases as the terminal showed them, one line each, and the same seconds in
    summary.json, MLflow's startup/*_s (at the first step) and the report's start-up column."""
    startup = summary["startup"]
    shown = [line for line in terminal.splitlines()   # a heartbeat comes under a heavy load only
             if line.startswith("startup  ") and not line.startswith("startup  still ")]
    assert [line.rsplit(" ", 2)[0] for line in shown[:-1]] == [
        "startup  launcher and runner", "startup  imports",
        "startup  model built on cpu (from config, fp32)", "startup  data synthetic",
        "startup  engine", "startup  trackers"], shown   # nothing was resumed: no resume line
    assert shown[-1] == (f"startup  first step {startup['first_step_s']:.1f} s · "
                         f"{startup['to_first_step_s']:.1f} s to step 1")
    assert shown[2] == f"startup  model built on cpu (from config, fp32) {startup['model_s']:.1f} s"
    assert terminal.index(shown[-1]) < terminal.index("step 2/40")   # before training's lines
    phases = sum(value for key, value in startup.items()
                 if key.endswith("_s") and key != "to_first_step_s")
    assert startup["to_first_step_s"] == pytest.approx(phases, abs=0.01) and startup["model_s"] > 0
    client = tracking.client_for(uri)
    for key, value in startup.items():
        if key.endswith("_s"):
            history = client.get_metric_history(run_id, f"startup/{key}")
            assert [(m.step, m.value) for m in history] == [(1, value)]
    assert float(row["startup_s"]) == startup["to_first_step_s"]
    assert all(float(row[f"startup_{key}"]) == value for key, value in startup.items()
               if key.endswith("_s") and key != "to_first_step_s")
