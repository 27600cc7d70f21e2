"""Every refusal `jobspec launch` makes before a rank starts is reported by `jobspec validate` or by
`jobspec launch --dry-run` (issue 24 item 5): a user who runs either learns of it without starting a job.

REFUSALS lists the launch path's refusal sites (each function of the modules below that builds a
SpecError, SpecIssue or positioned issue, with how many it builds) and, for each, how it is shown
reported: a CASE run here in process through jobspec.cli.main on a tiny spec under tmp_path (validate
first, then the dry run when validate passes; exit 2, the text, no traceback, nothing created), an
existing test that shows it through --dry-run or validate, or why no dry run can see it. A refusal
added to these modules, or a site that builds one more, fails `test_every_pre_rank_refusal_is_listed`
until it is listed here with its proof.
"""
from __future__ import annotations

import ast
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from jobspec.cli import main
from tests.conftest import REPO_ROOT, deep_merge

# The modules a launch runs before any rank starts (docs/architecture.md, `jobspec launch`); the
# validation rules themselves (spec/validation.py, spec/rules/) are validate's.
LAUNCH_PATH = [*sorted((REPO_ROOT / "jobspec" / "launch").glob("*.py")),
               *(REPO_ROOT / "jobspec" / p for p in ("memory/at_launch.py", "job/prepare.py", "job/checks.py",
                                                      "job/model_config.py", "data/preflight.py",
                                                      "spec/inputs.py", "data/formats/__init__.py", "compile/compiler.py",
                                                      "data/record_checks.py"))]
BUILDERS = {"spec_error", "SpecError", "SpecIssue"}


def refusal_sites() -> dict[str, int]:
    """`module:function` -> how many SpecErrors / SpecIssues / `.issue(...)`s it builds."""
    sites: dict[str, int] = {}
    for path in LAUNCH_PATH:
        module = path.relative_to(REPO_ROOT / "jobspec").with_suffix("").as_posix()

        def walk(node: ast.AST, function: str | None) -> None:
            for child in ast.iter_child_nodes(node):
                inner = function
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = child.name if function is None else f"{function}.{child.name}"
                if isinstance(child, ast.Call):
                    called = child.func
                    name = called.id if isinstance(called, ast.Name) else \
                        called.attr if isinstance(called, ast.Attribute) else None
                    if name in BUILDERS or (name == "issue" and isinstance(called, ast.Attribute)):
                        key = f"{module}:{inner}"
                        sites[key] = sites.get(key, 0) + 1
                walk(child, inner)

        walk(ast.parse(path.read_text(encoding="utf-8")), None)
    return sites


# ---------------------------------------------------------------- the cases run here

GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128, "vocab_size": 2048}
DATA = REPO_ROOT / "jobs" / "data"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def base_spec(tmp_path: Path) -> dict:
    return {"name": "refusals", "output_dir": str(tmp_path / "out"),
            "model": {"architecture": "gpt2", "task": "causal-lm", "config": GPT2},
            "data": {"synthetic": {"num_samples": 16, "seq_len": 32, "vocab_range": [5, 100]},
                     "num_workers": 0, "pin_memory": False},
            "training": {"max_steps": 2, "micro_batch_size": 2},
            "checkpoint": {"dir": str(tmp_path / "ckpt")},
            "logging": {"mlflow": {"enabled": False}}, "resources": {"gpus_per_node": 1}}


def file_data(tmp_path: Path, rows: list | None = None, **data) -> dict:
    if rows is not None:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        data.setdefault("train", str(path))
    return {"data": {"synthetic": None, "tokenizer": str(DATA / "tokenizer"), "max_length": 64, **data}}


@dataclass
class Case:
    """A spec (changes to base_spec) that launch refuses before any rank; `setup` (tmp_path,
    monkeypatch) prepares the host and returns the changes."""

    setup: Callable
    expected: str
    label: str = ""
    unrefused: dict = field(default_factory=dict)   # command -> why it passes what the others refuse


@dataclass
class Covered:
    """An existing test that shows the refusal through `--dry-run` or `validate` (or prepare_job, the
    path both take); named as `file::test`."""

    test: str


@dataclass
class NotVisible:
    """A refusal no dry run can see, and why."""

    why: str


@dataclass
class Listed:
    count: int
    proofs: list = field(default_factory=list)


def _vocab_txt_tokenizer(tmp_path, monkeypatch):
    directory = tmp_path / "wordpiece"
    directory.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
    (directory / "vocab.txt").write_text("\n".join(words) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    return deep_merge(file_data(tmp_path, [{"text": "w1 w2"}] * 4, tokenizer=str(directory)),
                      {"model": {"config": {**GPT2, "vocab_size": 30}}})


def _failing_template(tmp_path, monkeypatch):
    template = tmp_path / "no-system.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                        "turn') }}{% endif %}{{ m['content'] }}{% endfor %}")
    rows = [{"messages": CHAT}, {"messages": [{"role": "system", "content": "x"}, *CHAT]}]
    return file_data(tmp_path, rows, chat_template=str(template))


def _hub_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return file_data(tmp_path, [{"text": "a b"}] * 4, tokenizer="nobody/no-such-tokenizer")


def _held_port(tmp_path, monkeypatch):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    monkeypatch.setattr(_held_port, "sock", sock, raising=False)   # held until the test ends
    return {"resources": {"master_port": sock.getsockname()[1]}}


def _small_disk(tmp_path, monkeypatch):
    from jobspec.launch import preflight
    monkeypatch.setattr(preflight, "disk_of", lambda directory: (1, 1024))
    return {}


def _no_compiler(tmp_path, monkeypatch):
    from jobspec import ops
    monkeypatch.setattr(ops, "build_problems", lambda needed: [(b, f"{b} cannot be built here: no C++ compiler")
                                                               for b in needed])
    return {"memory": {"zero_stage": 2, "offload": {"optimizer": "cpu"}}}


def _live_lease(tmp_path, monkeypatch):
    from jobspec.launch import lease
    (tmp_path / "ckpt").mkdir()
    held = lease.acquire(tmp_path / "ckpt", "refusals")
    monkeypatch.setattr(_live_lease, "held", held, raising=False)
    return {}


def _unreadable_owner(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "jobspec_job.json").write_text("{not json")
    return {}


def _unclaimed_files(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "global_step4").mkdir()
    return {}


def _late_bad_csv(tmp_path, monkeypatch):
    from jobspec.data import record_checks as datacheck
    monkeypatch.setattr(datacheck, "PREFLIGHT_BYTES", 4096)   # validate reads a file's first bytes only
    path = tmp_path / "rows.csv"   # validate reads the first 4 KiB here; counting the rows reads all
    path.write_bytes(b"text\n" + b"a b c\n" * 1005 + b"\xff\xfe bad\n")
    return deep_merge(file_data(tmp_path, train=str(path)), {"training": {"max_steps": None, "epochs": 1}})


def _incapable_bitsandbytes(tmp_path, monkeypatch):
    from bitsandbytes import functional

    from jobspec import hardware

    def no_kernel(*args, **kwargs):   # what a backend without a 4-bit kernel raises inside bitsandbytes
        raise NotImplementedError("no 4-bit quantisation kernel for this backend")

    monkeypatch.setattr(functional, "quantize_4bit", no_kernel)
    monkeypatch.setattr(hardware, "gpu_names", lambda: ["cpu"])   # CPU ranks, as on this machine
    return {"model": {"lora": {"r": 4}, "quantization": {"bits": 4}}}


HOST_ONLY = "the launching host's, not the job's: plan and compile describe the job on any machine"
LAUNCH_ONLY = {"plan": HOST_ONLY, "compile": HOST_ONLY}
EPOCHS = {"training": {"max_steps": None, "epochs": 1}}

CASES = {
    "tokenizer-vocab": Case(_vocab_txt_tokenizer, "40 tokens but the model's vocabulary only 30"),
    "template-render": Case(_failing_template, "rows.jsonl:2: the chat template failed on this record: no system"),
    "tokenizer-load": Case(_hub_tokenizer, "cannot load tokenizer 'nobody/no-such-tokenizer'"),
    "bad-record": Case(lambda t, m: file_data(t, [{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}]),
                       "rows.jsonl:2: message 1 has role 'bot'"),
    "text-dir": Case(lambda t, m: (t / "empty").mkdir() or file_data(t, train=str(t / "empty")),
                     "is a directory, not a data file"),
    # enough samples for one global batch of 512 ranks' micro-batches (fewer are refused by validate)
    "ranks": Case(lambda t, m: {"resources": {"gpus_per_node": 512}, "data": {"synthetic": {"num_samples": 2048}}},
                  "512 ranks per node but this host has", unrefused=LAUNCH_ONLY),
    "port": Case(_held_port, "is already in use on this host", unrefused=LAUNCH_ONLY),
    "disk": Case(_small_disk, "share a disk with 1.0 KiB free", unrefused=LAUNCH_ONLY),
    "op-build": Case(_no_compiler, "CPUAdamBuilder cannot be built here", unrefused=LAUNCH_ONLY),
    "lease": Case(_live_lease, "is already being launched into", unrefused=LAUNCH_ONLY),
    "owner-unreadable": Case(_unreadable_owner, "jobspec_job.json is unreadable", unrefused=LAUNCH_ONLY),
    "unclaimed": Case(_unclaimed_files, "already holds files that no jobspec job claims", unrefused=LAUNCH_ONLY),
    "fit-nothing": Case(lambda t, m: {"memory": {"fit": "auto", "gpu_memory": "1MiB"}}, "nothing fits in 1.0 MiB",
                        unrefused={"plan": "plan shows the spec as written (memory.fit is not applied: --fit shows "
                                           "what it would change), and says it does not fit"}),
    "row-count": Case(_late_bad_csv, "cannot count the rows of"),
    "epochs-hub": Case(lambda t, m: deep_merge(file_data(t, train="hf:nobody/none"), EPOCHS),
                       "training.epochs needs the number of training samples, and hf:nobody/none is a dataset by name"),
    "epochs-text": Case(lambda t, m: deep_merge(file_data(t, train=str(DATA / "corpus-sample.txt")), EPOCHS),
                        "corpus-sample.txt is text"),
    "bnb-backend": Case(_incapable_bitsandbytes,
                        "bitsandbytes cannot quantise 4-bit on this machine: no 4-bit quantisation kernel", unrefused=LAUNCH_ONLY),
    "config-typo": Case(lambda t, m: {"model": {"config": {**GPT2, "n_emdb": 32}}},
                        "unknown key `n_emdb` for GPT2Config (gpt2)"),
    "lora-typo": Case(lambda t, m: {"model": {"lora": {"r": 4, "target_modules": ["c_atn"]}}},
                      "target module pattern 'c_atn' matches no module LoRA can adapt in GPT2LMHeadModel"),
    "pad-beyond-vocab": Case(lambda t, m: {"model": {"config": {**GPT2, "pad_token_id": 4096}}},
                             "pad_token_id 4096 (model.config) is not below vocab_size 2048"),
    "model-unbuildable": Case(lambda t, m: {"model": {"config": {**GPT2, "n_head": 3}}},
                              "model.config.n_embd: transformers cannot build 'gpt2' from this model.config",
                              unrefused={"compile": "compile builds no model (it stays torch-free): the keys, "
                                                    "types and ids are validate's, the build is plan's and launch's"}),
    "ds-batch-override": Case(lambda t, m: {"deepspeed": {"train_batch_size": 64}}, "train_batch_size"),
}

REFUSALS: dict[str, Listed] = {
    "data/preflight:tokenizer_issues": Listed(3, ["tokenizer-vocab", "template-render", "tokenizer-load"]),
    "job/checks:model_data_checks": Listed(2, ["tokenizer-vocab", Covered(
        "tests/spec/test_job_model_config.py::test_an_unknown_model_type_is_refused_before_anything_is_derived")]),
    "launch/pipeline:quantization_check": Listed(2, ["bnb-backend"]),
    "launch/pipeline:host_checks": Listed(2, ["ranks", "op-build"]),
    "launch/pipeline:_launch_validated": Listed(1, [NotVisible(
        "the checkpoints changed between the lineage choice and the lease: a race between two launches")]),
    "launch/preflight:preflight_issues": Listed(2, ["ranks", "port"]),
    "launch/preflight:op_build_issues": Listed(1, ["op-build"]),
    "launch/preflight:disk_space_issues": Listed(2, ["disk"]),
    "launch/preflight:refusal": Listed(2, ["ranks", "port", "disk"]),
    "launch/lease:acquire": Listed(1, [NotVisible("the lease keeps changing hands while this launch takes it: "
                                                  "launches racing for it")]),
    "launch/lease:refusal": Listed(1, ["lease"]),
    "launch/decision:_changed_spec": Listed(3, [Covered("tests/launch/test_lineage.py::"
                                                         "test_dry_run_refuses_a_changed_spec_with_exit_2")]),
    "launch/decision:unreadable_owner": Listed(1, ["owner-unreadable"]),
    "launch/decision:claim": Listed(3, ["unclaimed", Covered(
        "tests/launch/test_launch_ux.py::test_dry_run_refuses_what_a_launch_would_refuse")]),
    "job/model_config:job_model_config_issues": Listed(2, [
        Covered("tests/spec/test_job_model_config.py::test_a_hub_config_that_cannot_be_read_is_a_positioned_error"),
        Covered("tests/spec/test_job_model_config.py::"
                "test_an_unknown_model_type_is_refused_before_anything_is_derived")]),
    "launch/from_run:fetch_spec": Listed(5, [Covered("tests/launch/test_from_run.py::"
                                                     "test_unknown_run_and_run_without_spec_exit_2")]),
    "launch/from_run:relaunch_spec": Listed(2, [Covered("tests/launch/test_from_run.py::"
                                                        "test_unknown_run_and_run_without_spec_exit_2")]),
    "launch/from_run:job_argument": Listed(3, [Covered("tests/launch/test_from_run.py::"
                                                       "test_unknown_run_and_run_without_spec_exit_2")]),
    "launch/slurm:expand_hostlist": Listed(1, [NotVisible("SLURM_JOB_NODELIST of the allocation the launch runs "
                                                          "in; a dry run on a login node has none")]),
    "launch/slurm:allocation_backend": Listed(1, [NotVisible("resources.nodes against the Slurm allocation the launch "
                                                      "runs in (jobspec sbatch writes the matching --nodes)")]),
    "launch/slurm:_directive_value": Listed(1, [NotVisible("`jobspec sbatch`'s, not launch's")]),
    "launch/slurm:sbatch_directives": Listed(1, [NotVisible("`jobspec sbatch`'s, not launch's")]),
    "launch/slurm:submit": Listed(2, [NotVisible("`jobspec sbatch --submit`'s, not launch's")]),
    "memory/at_launch:plan_at_launch": Listed(2, ["fit-nothing"]),
    "memory/at_launch:_rechecked": Listed(1, [Covered(
        "tests/test_prepare_job.py::test_a_fit_change_that_breaks_a_rule_is_refused_with_the_rules_message")]),
    "data/formats/__init__:count_rows": Listed(1, ["row-count"]),
    "data/formats/__init__:file_format": Listed(1, [NotVisible(
        "an extension `data.format: auto` cannot read: validate refuses it first (spec/rules/data)")]),
    "compile/compiler:compile_spec": Listed(1, ["epochs-hub", "epochs-text"]),
    "compile/compiler:assert_deepspeed_accepts": Listed(1, [NotVisible(
        "DeepSpeed refusing the compiled config: validate checks `deepspeed:` against DeepSpeed's own config "
        "tables first (spec/freeform.py); --dry-run compiles and would report what is left")]),
    "compile/compiler:apply_overrides": Listed(1, ["ds-batch-override"]),
    "compile/compiler:assert_no_auto": Listed(1, [NotVisible(
        "\"auto\" in the compiled config: validate refuses it in `deepspeed:` (schema), the compiler writes none")]),
    "data/record_checks:check_source": Listed(1, ["text-dir"]),
    "data/record_checks:file_issues": Listed(1, [Covered(
        "tests/spec/test_record_issues.py::test_a_limit_then_a_count")]),
    "data/record_checks:file_issues.bad": Listed(1, ["bad-record", Covered(
        "tests/spec/test_record_issues.py::test_every_bad_record_at_its_line_from_validate_plan_and_compile")]),
    "data/record_checks:record_issues": Listed(1, [NotVisible(
        "a text directory that lost its files between data_sources' rule (validate: `text-dir`) and this read")]),
    "data/record_checks:locate_error": Listed(1, [NotVisible("the ranks' side: the file:line of a row a rank failed on")]),
    "data/record_checks:unreadable": Listed(1, [NotVisible("the ranks' side: a file datasets could not read")]),
}


def test_every_pre_rank_refusal_is_listed():
    found = refusal_sites()
    listed = {site: entry.count for site, entry in REFUSALS.items()}
    new = {site: n for site, n in found.items() if listed.get(site) != n}
    gone = sorted(set(listed) - set(found))
    assert not new, (f"pre-rank refusals not listed in tests/test_refusals.py (or with another count): {new}; "
                     "add each with the case or test that shows validate or --dry-run reports it")
    assert not gone, f"listed refusals no longer in the code: {gone}"
    for site, entry in REFUSALS.items():
        assert entry.proofs, site
        for proof in entry.proofs:
            assert isinstance(proof, (Covered, NotVisible)) or proof in CASES, (site, proof)


@pytest.mark.parametrize("proof", sorted({p.test for e in REFUSALS.values() for p in e.proofs
                                          if isinstance(p, Covered)}))
def test_the_named_tests_exist_and_go_through_the_cli_or_prepare_job(proof):
    file, name = proof.split("::")
    tree = ast.parse((REPO_ROOT / file).read_text(encoding="utf-8"))
    function = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert function is not None, proof
    source = ast.unparse(function)
    assert "'--dry-run'" in source or "'validate'" in source or "prepare_job" in source, proof


COMMANDS = {"validate": ["validate"], "plan": ["plan"], "compile": ["compile"], "dry-run": ["launch", "--dry-run"]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_plan_compile_and_dry_run_refuse_alike(name, tmp_path, monkeypatch, capsys):
    """The column: each case through all four commands. validate refusing means all four refuse (the
    others validate first); else plan, compile and --dry-run all refuse it, the same words at the
    spec's line, unless the case says why only a launch can (the host's port, disk, lease, ...)."""
    monkeypatch.chdir(tmp_path)
    case = CASES[name]
    spec = deep_merge(base_spec(tmp_path), case.setup(tmp_path, monkeypatch))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    refused = {}
    for command, argv in COMMANDS.items():
        code = main([argv[0], str(job), *argv[1:]])
        out = capsys.readouterr()
        said = out.err + out.out
        assert "Traceback" not in said, (command, said)
        assert code in (0, 2) or (command, code) == ("plan", 1), (command, code, said)   # plan: 1 = does not fit
        if code == 2:
            assert case.expected in said, (command, said)
            assert "job.yaml:" in said or "<--set>" in said, (command, said)   # at the spec's line
            refused[command] = said
    if "validate" in refused:
        assert set(refused) == set(COMMANDS), (name, sorted(refused))
    else:
        assert set(refused) == {"plan", "compile", "dry-run"} - set(case.unrefused), (name, sorted(refused))
    assert not (tmp_path / "out").exists()
