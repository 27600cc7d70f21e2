"""memory/plan_cache: a plan or launch of an unchanged spec reads the model's profile and the
checks' outcome from the plan cache instead of tracing and checking again, and says exactly what
the traced one said; a change that can change them misses, one that cannot (name, logging) hits;
a damaged entry is computed again; the warm path imports neither torch nor transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import spec_builder
from conftest import REPO_ROOT

from jobspec.cli import main
from jobspec.job import checks
from jobspec.launch import supervise
from jobspec.memory import plan_cache
from jobspec.model import planner_trace

HEAVY = ("torch", "transformers", "deepspeed")
DATA = REPO_ROOT / "jobs" / "data"
# a small causal LM on the shipped chat records and tokenizer: the tokenizer and chat-template
# checks, the config transformers builds and the data lines all run on its path
CHAT_JOB = {
    "model": spec_builder.replace({
        "architecture": "llama", "task": "causal-lm",
        "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 2048,
                   "max_position_embeddings": 256}}),
    "data": {"synthetic": spec_builder.DROP, "max_length": 128,
             "train": str(DATA / "chat-sample.jsonl"), "tokenizer": str(DATA / "tokenizer")},
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of this test's own: traces, plans, tokenised data."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("JOBSPEC_CACHE_DIR", str(directory))
    monkeypatch.setenv("JOBSPEC_LOG_DIR", str(tmp_path / "logs"))
    plan_cache.environment.cache_clear()   # the code as it is now, as a fresh process hashes it
    return directory


@pytest.fixture
def traced(monkeypatch):
    """(micro-batch, sequence length) of each profile asked of the tracer: the cache's misses."""
    asked = []
    real = planner_trace.job_profiler

    def counting(*args, **kwargs):
        profiler = real(*args, **kwargs)

        def profile(spec, seq_len):
            asked.append((spec["training"]["micro_batch_size"], seq_len))
            return profiler(spec, seq_len)
        return profile

    monkeypatch.setattr(planner_trace, "job_profiler", counting)
    return asked


@pytest.fixture
def checked(monkeypatch):
    """The specs whose config transformers built (job/checks.config_check): the checks that ran."""
    ran = []
    real = checks.config_check

    def counting(resolved):
        ran.append(resolved.spec["name"])
        return real(resolved)

    monkeypatch.setattr(checks, "config_check", counting)
    return ran


def plan_output(capsys, *argv) -> tuple[int, str]:
    code = main(["plan", *map(str, argv)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("options", [["--format", "json"], [], ["--fit", "--gpu-mem", "60MiB"]],
                         ids=["json", "text", "fit"])
def test_a_warm_plan_prints_what_the_cold_one_printed(tmp_path, cache, traced, checked, capsys,
                                                      options):
    job = spec_builder.write_job(tmp_path)
    cold = plan_output(capsys, job, *options)
    assert traced and checked == ["tiny"]
    traced.clear()
    warm = plan_output(capsys, job, *options)
    assert warm == cold
    assert traced == [] and checked == ["tiny"]   # neither traced nor checked again
    if options[:1] == ["--fit"]:   # a profile per candidate setting
        assert "fit:" in cold[1] and len(list((cache / "plans").glob("*.json"))) > 1


IRRELEVANT = ("name=renamed", "description=another", "logging.every_n_steps=5",
              "training.max_steps=80", "training.optimizer.lr=0.1", "output_dir=elsewhere")
# an override and the (micro-batch, sequence length) the tracer is asked for then
RELEVANT = (("training.micro_batch_size=2", (2, 16)), ("data.synthetic.seq_len=32", (4, 32)),
            ("memory.precision=bf16", (4, 16)), ("memory.activation_checkpointing=true", (4, 16)),
            ("memory.zero_stage=2", (4, 16)), ("resources.gpus_per_node=1", (4, 16)))


def test_a_field_that_changes_the_plan_misses_and_one_that_cannot_hits(tmp_path, cache, traced,
                                                                       capsys):
    job = spec_builder.write_job(tmp_path)
    plan_output(capsys, job)
    for override in IRRELEVANT:
        traced.clear()
        plan_output(capsys, job, "--set", override)
        assert traced == [], override
    for override, asked in RELEVANT:
        traced.clear()
        plan_output(capsys, job, "--set", override)
        assert traced == [asked], override


def test_the_key_follows_the_files_the_versions_and_the_code(tmp_path, monkeypatch):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    spec = spec_builder.build_spec()
    spec["data"]["tokenizer"] = str(tokenizer)
    spec["data"]["synthetic"] = None   # the tokenizer is read for file data only
    key = plan_cache.profile_key(spec, 16)
    assert plan_cache.profile_key(spec, 16) == key and plan_cache.profile_key(spec, 32) != key
    (tokenizer / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    changed = plan_cache.profile_key(spec, 16)
    assert changed != key
    environment = plan_cache.environment()
    for name, value in (("versions", {**environment["versions"], "torch": "0.0"}),
                        ("code", "another")):
        monkeypatch.setattr(plan_cache, "environment", lambda: {**environment, name: value})
        assert plan_cache.profile_key(spec, 16) != changed, name


def test_a_damaged_entry_is_computed_again(tmp_path, cache, traced, checked, capsys):
    job = spec_builder.write_job(tmp_path)
    cold = plan_output(capsys, job, "--format", "json")
    entries = sorted((cache / "plans").rglob("*.json"))
    assert {p.parent.name for p in entries} == {"plans", "inventories", "checks"}
    for path in entries:
        path.write_text(path.read_text()[:-7])   # cut short: no longer JSON
    traced.clear()
    checked.clear()
    assert plan_output(capsys, job, "--format", "json") == cold
    assert traced and checked == ["tiny"]
    for path in entries:
        json.loads(path.read_text())   # written again, whole
    inventory = next((cache / "plans" / "inventories").glob("*.json"))
    wrong = {**json.loads(inventory.read_text()), "num_layers": 7}   # it parses, but is not itself
    inventory.write_text(json.dumps(wrong))
    traced.clear()
    assert plan_output(capsys, job, "--format", "json") == cold
    assert traced


def test_a_hub_model_is_checked_every_time():
    spec = spec_builder.build_spec()
    spec["model"]["name_or_path"] = "some-org/some-model"
    assert checks.checks_key(spec) is None and not checks.checks_passed(spec)


def heavy_modules_of_a_plan(job: Path, cache: Path, tmp_path: Path) -> tuple[list, str]:
    """The heavy modules a `jobspec plan` imports, in a fresh interpreter, and what it printed."""
    code = ("import sys\nfrom jobspec.cli import main\ncode = main(['plan', sys.argv[1]])\n"
            f"print('HEAVY', *(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
            "sys.exit(code)\n")
    env = {**os.environ, "JOBSPEC_CACHE_DIR": str(cache), "JOBSPEC_LOG_DIR": str(tmp_path / "logs")}
    done = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    heavy = next(line for line in done.stderr.splitlines() if line.startswith("HEAVY"))
    return heavy.split()[1:], done.stdout


@pytest.mark.parametrize("sections", [{}, CHAT_JOB], ids=["synthetic", "chat"])
def test_a_warm_plan_imports_neither_torch_nor_transformers(tmp_path, cache, traced, capsys,
                                                            sections):
    job = spec_builder.write_job(tmp_path, **sections)
    code, cold = plan_output(capsys, job)   # in this process, where the heavy imports are made
    assert code == 0 and traced
    heavy, warm = heavy_modules_of_a_plan(job, cache, tmp_path)
    assert heavy == [] and warm == cold
    if sections:   # the tokenizer's facts and the data pass's estimate were remembered too
        assert "data: data.train: not tokenised yet (cold): about 300 records" in warm


def test_the_trace_of_a_tiled_job_prints_nothing_of_deepspeeds_into_the_plan(tmp_path, cache):
    """The trace runs DeepSpeed's tiled loss: importing DeepSpeed in a fresh process says "Setting
    accelerator to CPU" on stdout, which went into the cold plan's output and not the warm one's."""
    job = spec_builder.write_job(tmp_path, model=CHAT_JOB["model"], memory={"tiled_loss": True})
    heavy, cold = heavy_modules_of_a_plan(job, cache, tmp_path)
    assert "deepspeed" in heavy and "accelerator" not in cold
    heavy, warm = heavy_modules_of_a_plan(job, cache, tmp_path)
    assert heavy == [] and warm == cold


def test_a_dry_run_reuses_the_plan_of_an_unchanged_spec(tmp_path, cache, traced, checked, capsys,
                                                        monkeypatch):
    job = spec_builder.write_job(tmp_path)
    monkeypatch.setattr(supervise, "run", lambda *a, **k: pytest.fail("dry run started the runner"))
    plan_output(capsys, job)
    traced.clear()
    assert main(["launch", str(job), "--dry-run"]) == 0
    first = capsys.readouterr().out
    assert traced == [] and checked == ["tiny"]   # the plan's profile and checks, reused
    assert main(["launch", str(job), "--dry-run", "--set", "memory.zero_stage=2"]) == 0
    assert traced == [(4, 16)] and checked == ["tiny", "tiny"]   # another spec: anew
    capsys.readouterr()
    traced.clear()
    assert main(["launch", str(job), "--dry-run"]) == 0
    assert traced == [] and checked == ["tiny", "tiny"]
    assert header_plan(capsys.readouterr().out) == header_plan(first) != []


def header_plan(out: str) -> list[str]:
    """The header's lines that show the plan, up to what the host has now."""
    return [line.split(" · ")[0] for line in out.splitlines() if " plan " in line]
