"""`python -m bench gpu-startup` without a GPU: its jobs are valid specs as they will run, its dry
run checks them with `jobspec validate` and `jobspec plan` and refuses a bad one, the table's phases
add up to the command's time to the first step, and a real CPU launch is timed and stopped."""
from __future__ import annotations

import json

import psutil
import pytest

from bench import gpu_startup

CHEAP = "tinyllama-2x2048"


def test_jobs_are_the_brief_and_validate_as_they_run(tmp_path):
    from jobspec.spec.derived import derive
    from jobspec.spec.validation import load_and_validate

    jobs = {j.name: j for j in gpu_startup.JOBS}
    assert list(jobs) == ["llama-1b-64k", "llama-8b-qlora-32k", "llama-1b-64k-forked",
                          "tinyllama-2x2048"]
    assert [j.target_s for j in gpu_startup.JOBS] == [20, 60, 20, None]
    assert dict(jobs["llama-1b-64k-forked"].env) == {"JOBSPEC_FORK_RANKS": "1"}
    # every limit and stop fits the session's budget, and that fits a 5-minute call
    assert sum(j.limit_s for j in gpu_startup.JOBS) <= gpu_startup.BUDGET_S <= 300
    for job in gpu_startup.JOBS:
        resolved = load_and_validate(str(gpu_startup.job_file(job, tmp_path)),
                                     gpu_startup.job_sets(job, tmp_path))
        spec = resolved.spec
        assert spec["logging"]["mlflow"]["enabled"] is False and spec["export"]["final"] is False
        assert spec["checkpoint"]["save_final"] is False and spec["training"]["eval_every"] is None
        assert spec["output_dir"] == str(tmp_path / job.name / "out")
        derived = derive(spec)
        assert derived.total_steps == 2 and derived.gradient_accumulation_steps == 1
    spec_1b = load_and_validate(str(gpu_startup.job_file(jobs["llama-1b-64k"], tmp_path))).spec
    assert spec_1b["data"]["synthetic"]["seq_len"] == 65536 and spec_1b["memory"]["tiled_loss"]
    qlora = load_and_validate(str(gpu_startup.job_file(jobs["llama-8b-qlora-32k"], tmp_path))).spec
    assert qlora["model"]["quantization"]["bits"] == 4
    assert qlora["model"]["config"]["hidden_size"] == 4096


def test_dry_run_checks_the_job_and_says_what_it_measures(tmp_path, capsys):
    out = tmp_path / "startup.md"
    code = gpu_startup.main(["--dry-run", "--jobs", CHEAP, "--out", str(out),
                             "--work", str(tmp_path / "w")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "nothing is launched" in printed and "Dry run: nothing launched" in printed
    line = next(x for x in printed.splitlines() if x.startswith(f"- {CHEAP} "))
    assert "llama 22 layers x 2048, vocab 32000, 2048 tokens x 2, bf16" in line
    assert "1.10 B parameters" in line and "no target" in line
    assert f"--set output_dir={tmp_path / 'w' / CHEAP / 'out'}" in printed
    assert "--set training.global_batch_size=2" in printed
    for group, _ in gpu_startup.PHASE_GROUPS:
        assert f" {group}, s |" in out.read_text()
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["dry_run"] is True and record["jobs"] == []
    # measured on the 2026-11-28 H200: 23.25 GiB
    assert 15 < record["planned"][CHEAP]["peak_allocated_gib"] < 40
    row = next(x for x in out.read_text().splitlines() if x.startswith(f"| {CHEAP} |"))
    assert row.endswith("| - | ~54 s | not run |")


def test_dry_run_refuses_a_job_that_does_not_validate(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_startup, "RUN_SETS", [*gpu_startup.RUN_SETS, "training.max_steps=-1"])
    with pytest.raises(SystemExit, match="tinyllama-2x2048: jobspec validate failed"):
        gpu_startup.main(["--dry-run", "--jobs", CHEAP, "--work", str(tmp_path)])


def test_no_gpu_no_launch(tmp_path, capsys):
    from jobspec import hardware

    if hardware.gpu_count():
        pytest.skip("this host has an NVIDIA GPU")
    assert gpu_startup.main(["--work", str(tmp_path), "--out", str(tmp_path / "s.md")]) == 2
    assert "no NVIDIA GPU here" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_job_is_refused():
    with pytest.raises(SystemExit, match="no job nope"):
        gpu_startup.select("nope")


def phase_log(names: list[str], at: float = 1000.0) -> str:
    """launcher.log phase lines, one second apart from `at`."""
    return "".join(f"jobspec-log: phase {n.split('/')[0]} {n.split('/')[1]} {at + i:.3f} 0.500\n"
                   for i, n in enumerate(names))


CHAIN = ["launcher/start", "launcher/planned", "launcher/data", "launcher/runner", "rank0/start",
         "rank0/worker", "rank0/imported", "rank0/ops", "rank0/distributed",
         "rank0/imported-model-code", "rank0/model", "rank0/data", "rank0/engine", "rank0/resumed",
         "rank0/sink", "rank0/loop", "rank0/first-step"]


def test_the_phases_cover_the_command_to_the_first_step_once():
    from bench.startup import read_phases

    marks, _ = read_phases("rank0 says hello\n" + phase_log(CHAIN))
    marks["cmd"] = 999.5
    groups = gpu_startup.phases(marks)
    total = marks["rank0/first-step"] - 999.5
    assert sum(v for v in groups.values() if v is not None) == pytest.approx(total)
    assert groups["model build"] == 1.0 and groups["imports"] == 3.0 and groups["launcher"] == 2.5
    assert groups["data"] == 2.0 and groups["first step"] == 1.0
    # each stretch between two consecutive marks is in exactly one group
    order = ["cmd", *CHAIN[1:]]
    stretches = [(order[i], order[i + 1]) for _, group in gpu_startup.PHASE_GROUPS for a, b in group
                 for i in range(order.index(a), order.index(b))]
    assert sorted(stretches) == sorted(zip(order, order[1:]))


def test_a_job_stopped_short_names_the_phase_it_was_in():
    from bench.startup import read_phases

    job = gpu_startup.JOBS[0]
    marks, _ = read_phases(phase_log(CHAIN[:CHAIN.index("rank0/imported-model-code") + 1]))
    marks["cmd"] = 999.0
    assert gpu_startup.phase_at(marks) == "rank: build model + patches"
    assert gpu_startup.phases(marks)["model build"] is None
    row = {"to_first_step_s": None, "stopped_at_s": 60.2, "exit_code": 130,
           "in_phase": gpu_startup.phase_at(marks)}
    assert gpu_startup.verdict(job, row) == \
        "no first step after 60 s (in rank: build model + patches)"
    assert gpu_startup.phase_at({"cmd": 1.0}) == "launcher (no phase line written)"
    assert gpu_startup.verdict(job, {**row, "stopped_at_s": None, "seconds": 12.0}).startswith(
        "failed: exit 130 after 12 s, no first step")
    assert gpu_startup.verdict(job, {"to_first_step_s": 19.5}) == "met (<= 20 s)"
    assert gpu_startup.verdict(job, {"to_first_step_s": 31.0}) == "missed by 11 s (target <= 20 s)"
    tiny = next(j for j in gpu_startup.JOBS if j.name == "tinyllama-2x2048")
    assert gpu_startup.verdict(tiny, {"to_first_step_s": 31.0}) == "no target"


def no_launch_left() -> bool:
    """No process of a launch still runs under this one (an exited one its parent has not reaped
    yet holds nothing)."""
    def running_launch(proc) -> bool:
        try:
            return proc.status() != psutil.STATUS_ZOMBIE and "jobspec" in " ".join(proc.cmdline())
        except psutil.Error:   # gone meanwhile
            return False
    return not [p for p in psutil.Process().children(recursive=True) if running_launch(p)]


@pytest.mark.slow
def test_a_cpu_launch_is_timed_and_one_past_its_limit_stopped(tmp_path):
    """The real path on a CPU rank: a tiny job reaches its first step; the same job with a limit
    inside the launcher's start is stopped, every process it started gone."""
    job = gpu_startup.StartupJob("cpu-tiny", "bench/jobs/cpu-1-fp32.yaml", 600, 240, "-")
    row = gpu_startup.run_job(job, tmp_path, job.limit_s)
    assert row["exit_code"] == 0 and row["stopped_at_s"] is None, row["output_tail"]
    assert row["to_first_step_s"] == pytest.approx(sum(row["phases"].values()), abs=0.05)
    assert row["marks"]["rank0/first-step"] == pytest.approx(row["to_first_step_s"], abs=0.01)
    assert 0 < row["to_first_step_s"] < row["seconds"]
    assert "--set training.max_steps=2" in row["command"] and row["in_phase"] is None
    assert gpu_startup.verdict(job, row) == "met (<= 600 s)"
    stopped = gpu_startup.run_job(job, tmp_path / "stopped", 1.0)
    assert stopped["to_first_step_s"] is None and 1.0 <= stopped["stopped_at_s"] < 2.0
    assert stopped["exit_code"] != 0 and no_launch_left()
    # where the second stopped depends on the machine: the plan cache makes the launcher's part short
    assert stopped["in_phase"] and stopped["in_phase"] != "first step"
    assert gpu_startup.verdict(job, stopped) == f"no first step after 1 s (in {stopped['in_phase']})"
