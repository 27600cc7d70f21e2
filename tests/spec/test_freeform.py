"""`model.config` and `deepspeed:` are checked at validate time against tables generated from the
installed transformers and DeepSpeed (jobspec/spec/freeform.py, scripts/gen_*.py)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobspec.compile.compiler import compile_spec
from jobspec.errors import SpecError
from jobspec.spec.inputs import derive_job
from jobspec.spec.model_dims import ARCHITECTURE_DEFAULTS
from jobspec.spec.schema import load_schema, subschema_at
from jobspec.spec import freeform
from jobspec.spec.freeform import OWNED_DEEPSPEED_KEYS, deepspeed_problems
from jobspec.spec.validation import load_and_validate

REPO = Path(__file__).resolve().parents[2]
XLMR = REPO / "jobs" / "xlmr-large.yaml"
SHIPPED_JOBS = sorted((REPO / "jobs").glob("*.yaml")) + sorted((REPO / "bench" / "jobs").glob("cpu-*.yaml"))
TINY = {"model": {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2,
                                                     "num_attention_heads": 2, "intermediate_size": 128}},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 16}}, "training": {"max_steps": 2}}


def write(tmp_path: Path, spec: dict, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def issues_of(path: Path, overrides=()) -> list:
    with pytest.raises(SpecError) as caught:
        load_and_validate(path, overrides)
    return caught.value.issues


def line_col(text: str, needle: str) -> tuple[int, int]:
    """1-based line and column of the first line of `text` that starts (after its indent) with `needle`."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(needle):
            return number, len(line) - len(line.lstrip()) + 1
    raise AssertionError(f"no line starts with {needle!r}")


def with_deepspeed(tmp_path: Path, section: dict, **memory) -> Path:
    return write(tmp_path, {**TINY, "memory": memory, "deepspeed": section})


# ---------------------------------------------------------------- model.config

def test_misspelled_model_config_key_is_positioned_with_did_you_mean(tmp_path):
    text = XLMR.read_text().replace("    hidden_size: 1024", "    hiddne_size: 1024")
    job = tmp_path / "xlmr-large.yaml"
    job.write_text(text)
    (issue,) = issues_of(job)
    assert (issue.file, issue.line, issue.column) == (str(job), *line_col(text, "hiddne_size"))
    assert issue.dotted_path == "model.config.hiddne_size"
    assert "unknown key `hiddne_size` for XLMRobertaConfig" in issue.message
    assert issue.hint == "did you mean `hidden_size`?"


def test_list_where_an_integer_belongs(tmp_path):
    text = XLMR.read_text().replace("num_hidden_layers: 24", "num_hidden_layers: [24]")
    job = tmp_path / "xlmr.yaml"
    job.write_text(text)
    (issue,) = issues_of(job)
    assert (issue.line, issue.column) == (line_col(text, "num_hidden_layers")[0], text.splitlines()[
        line_col(text, "num_hidden_layers")[0] - 1].index("[24]") + 1)
    assert issue.message == "expected an integer, got list"
    assert "24" in issue.hint


@pytest.mark.parametrize("key, value, words", [
    ("initializer_range", 1, "expected a number with a decimal point, got integer 1"),
    ("num_hidden_layers", "4", "expected an integer, got string '4'"),
    ("tie_word_embeddings", 1, "expected true or false, got integer 1"),
    ("problem_type", "regresion", "`regresion` is not an allowed value"),
])
def test_wrong_types_name_the_expected_type(tmp_path, key, value, words):
    spec = {**TINY, "model": {"architecture": "bert", "config": {key: value}}}
    (issue,) = issues_of(write(tmp_path, spec))
    assert issue.dotted_path == f"model.config.{key}" and words in issue.message


def test_the_table_agrees_with_transformers():
    """What the table refuses, transformers refuses too; a typo is what it silently keeps."""
    transformers = pytest.importorskip("transformers")
    for bad in ({"num_hidden_layers": [24]}, {"initializer_range": 1}):
        with pytest.raises(Exception):
            transformers.AutoConfig.for_model("xlm-roberta", **bad)
    config = transformers.AutoConfig.for_model("xlm-roberta", hiddne_size=1024)
    assert config.hidden_size == 768   # the silent failure the check exists for
    assert transformers.AutoConfig.for_model("gpt2", hidden_size=64).n_embd == 64   # an alias in the table


def test_aliases_and_common_keywords_are_accepted(tmp_path):
    spec = {**TINY, "model": {"architecture": "gpt2", "task": "causal-lm",
                              "config": {"hidden_size": 64, "n_layer": 2, "n_head": 2, "num_labels": 3,
                                         "output_attentions": False, "resid_pdrop": 0}}}
    assert load_and_validate(write(tmp_path, spec)).spec["model"]["config"]["hidden_size"] == 64
    spec["model"]["config"] = {"hidden_size": [64]}
    (issue,) = issues_of(write(tmp_path, spec))
    assert issue.message == "expected an integer, got list"   # an alias has its field's type


def test_attn_implementation_names_model_attention(tmp_path):
    spec = {**TINY, "model": {"architecture": "bert", "config": {"attn_implementation": "eager"}}}
    (issue,) = issues_of(write(tmp_path, spec))
    assert "model.attention" in issue.message and "model.attention" in issue.hint


def test_mlp_config_comes_from_its_dataclass(tmp_path):
    spec = {**TINY, "model": {"architecture": "mlp", "config": {"hidden_size": 32, "num_hidden_layers": 2}}}
    (issue,) = issues_of(write(tmp_path, spec))
    assert "unknown key `num_hidden_layers` for MLPConfig" in issue.message
    assert issue.hint == "did you mean `num_layers`?"


def test_architecture_outside_the_table_is_not_checked_here(tmp_path):
    spec = {**TINY, "model": {"architecture": "someformer", "config": {"anything": [1]}}}
    assert load_and_validate(write(tmp_path, spec))


def test_local_checkpoint_accepts_its_config_json_keys(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(
        {"model_type": "bert", "hidden_size": 64, "custom_flag": True, "_name_or_path": "x"}))
    spec = {**TINY, "model": {"name_or_path": "ckpt", "config": {"custom_flag": False, "hidden_dropout_prob": 0.2}}}
    assert load_and_validate(write(tmp_path, spec))
    spec["model"]["config"] = {"custom_flag": False, "hiddne_size": 32}
    job = write(tmp_path, spec)
    (issue,) = issues_of(job)
    assert (issue.line, issue.column) == line_col(job.read_text(), "hiddne_size")
    assert issue.hint == "did you mean `hidden_size`?"
    # without a model_type in config.json the class is unknown: only launch can check
    (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert load_and_validate(job)


# ---------------------------------------------------------------- deepspeed

def test_unknown_top_level_key(tmp_path):
    job = with_deepspeed(tmp_path, {"gradient_clippping": 0.5})
    (issue,) = issues_of(job)
    assert (issue.line, issue.column) == line_col(job.read_text(), "gradient_clippping")
    assert issue.dotted_path == "deepspeed.gradient_clippping"
    assert issue.hint == ("did you mean `gradient_clipping`? "
                          "jobspec sets it from `training.gradient_clipping`: set that instead")


def test_unknown_nested_key(tmp_path):
    job = with_deepspeed(tmp_path, {"zero_optimization": {"reduce_bucket_sise": 5}}, zero_stage=2)
    (issue,) = issues_of(job)
    assert (issue.line, issue.column) == line_col(job.read_text(), "reduce_bucket_sise")
    assert issue.dotted_path == "deepspeed.zero_optimization.reduce_bucket_sise"
    assert issue.hint == ("did you mean `reduce_bucket_size`? jobspec sets it from `memory.zero.reduce_bucket_size`: "
                          "set that instead")


def test_key_at_the_wrong_depth_says_where_it_belongs(tmp_path):
    (issue,) = issues_of(with_deepspeed(tmp_path, {"reduce_bucket_size": 5}))
    assert "deepspeed.zero_optimization.reduce_bucket_size" in issue.hint


@pytest.mark.parametrize("section, path, words", [
    ({"zero_optimization": {"overlap_comm": "yes"}}, "deepspeed.zero_optimization.overlap_comm",
     "expected true or false or null, got string 'yes'"),
    ({"flops_profiler": {"top_modules": [3]}}, "deepspeed.flops_profiler.top_modules", "expected an integer, got list"),
    ({"zero_optimization": {"stage3_max_live_parameters": -1}},
     "deepspeed.zero_optimization.stage3_max_live_parameters", "must be >= 0, got -1"),
    ({"zero_optimization": {"offload_optimizer": {"pin_memory": 1}}},
     "deepspeed.zero_optimization.offload_optimizer.pin_memory", "expected true or false, got integer 1"),
    ({"steps_per_print": "auto"}, "deepspeed.steps_per_print", '"auto" is resolved only by the HF Trainer'),
    ({"nebula": {"enabled": True}}, "deepspeed.nebula", "was removed from DeepSpeed"),
])
def test_wrong_values_are_positioned(tmp_path, section, path, words):
    job = with_deepspeed(tmp_path, section, zero_stage=2)
    (issue,) = issues_of(job)
    assert issue.dotted_path == path and words in issue.message, issue.render()
    assert issue.file == str(job) and issue.line > 1


def test_an_integral_number_is_an_integer_only_where_pydantic_parses(tmp_path):
    """DeepSpeed's pydantic sections coerce 5e8 to 500000000; keys it reads with dict.get take it as it is."""
    assert load_and_validate(with_deepspeed(tmp_path, {"zero_optimization": {"allgather_bucket_size": 5e8}},
                                            zero_stage=2))
    (issue,) = issues_of(with_deepspeed(tmp_path, {"aio": {"block_size": 1.048576e6}}))
    assert issue.message == "expected an integer, got number 1048576.0"
    assert issue.hint == "write 1048576 without a decimal point"
    if importlib.util.find_spec("deepspeed"):
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        assert DeepSpeedZeroConfig(allgather_bucket_size=5e8).allgather_bucket_size == 500_000_000
        with pytest.raises(ValueError):   # pydantic's ValidationError: what the ranks would hit
            DeepSpeedZeroConfig(reduce_bucket_sise=5)


@pytest.mark.parametrize("owned", sorted(OWNED_DEEPSPEED_KEYS), ids=".".join)
def test_owned_keys_are_refused_with_the_field_to_use(tmp_path, owned):
    section: dict = {}
    node = section
    for key in owned[:-1]:
        node = node.setdefault(key, {})
    node[owned[-1]] = True
    job = with_deepspeed(tmp_path, section, zero_stage=2)
    (issue,) = issues_of(job)
    assert issue.path == ("deepspeed",) + owned
    assert OWNED_DEEPSPEED_KEYS[owned] in issue.message
    assert (issue.line, issue.column) == line_col(job.read_text(), owned[-1] + ":")
    assert issue.hint


def test_hf_trainer_auto_values_name_the_field_that_replaces_them(tmp_path):
    job = with_deepspeed(tmp_path, {"train_batch_size": "auto", "zero_optimization": {
        "stage3_prefetch_bucket_size": "auto", "allgather_bucket_size": "auto"}}, zero_stage=3)
    issues = {i.dotted_path: i for i in issues_of(job)}
    assert set(issues) == {"deepspeed.train_batch_size", "deepspeed.zero_optimization.stage3_prefetch_bucket_size",
                           "deepspeed.zero_optimization.allgather_bucket_size"}
    assert "`training.global_batch_size`, as the HF Trainer does for \"auto\"" in \
        issues["deepspeed.train_batch_size"].message
    assert "memory.zero.stage3_prefetch_bucket_size" in issues[
        "deepspeed.zero_optimization.stage3_prefetch_bucket_size"].message
    assert "silently fall back" in issues["deepspeed.zero_optimization.allgather_bucket_size"].message


def test_zero_stage_override_names_memory_zero_stage(tmp_path):
    job = write(tmp_path, TINY)
    (issue,) = issues_of(job, ["deepspeed.zero_optimization.stage=3"])
    assert (issue.file, issue.line, issue.column) == ("<--set>", 1, 1)
    assert "`memory.zero_stage`" in issue.message and "memory.zero_stage" in issue.hint


def test_replacing_an_owned_section_is_refused(tmp_path):
    job = with_deepspeed(tmp_path, {"zero_optimization": {"offload_optimizer": None}}, zero_stage=2)
    (issue,) = issues_of(job)
    assert issue.dotted_path == "deepspeed.zero_optimization.offload_optimizer"
    assert "memory.offload.optimizer" in issue.message


def test_other_keys_of_owned_sections_compile_and_are_noted(tmp_path):
    section = {"zero_optimization": {"overlap_comm": False, "allgather_bucket_size": 1000,
                                     "stage3_gather_16bit_weights_on_model_save": True},
               "fp16": {"loss_scale_window": 100}, "flops_profiler": {"enabled": True, "top_modules": 3}}
    resolved = load_and_validate(with_deepspeed(tmp_path, section, zero_stage=2, precision="fp16"))
    compiled = compile_spec(resolved.spec, derive_job(resolved.spec))
    assert compiled.ds_config["zero_optimization"]["overlap_comm"] is False
    assert compiled.ds_config["fp16"]["enabled"] is True and compiled.ds_config["fp16"]["loss_scale_window"] == 100
    assert compiled.ds_config["flops_profiler"] == {"enabled": True, "top_modules": 3}
    notes = "\n".join(compiled.notes)
    assert "deepspeed.zero_optimization.overlap_comm overrides compiled True -> False" in notes
    assert "deepspeed.zero_optimization.allgather_bucket_size overrides compiled 500000000 -> 1000" in notes
    assert "deepspeed.fp16.loss_scale_window overrides compiled 1000 -> 100" in notes
    assert "deepspeed.flops_profiler adds {'enabled': True, 'top_modules': 3}" in notes


KEYS = st.sampled_from(["zero_optimization", "offload_optimizer", "device", "stage", "fp16", "enabled", "optimizer",
                        "tensor_parallel", "tp", "zenflow", "select_interval", "hidden_size", "auto", "x"]) \
    | st.text(max_size=6)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**9) | st.floats(allow_nan=False) |
                      st.sampled_from(["auto", "cpu", "", "5e8"]),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, VALUES, max_size=5), st.dictionaries(KEYS, VALUES, max_size=5),
       st.sampled_from(["bert", "gpt2", "mlp", "llama", None]))
def test_any_block_gives_problems_never_an_exception(deepspeed_section, config, architecture):
    spec = {"model": {"architecture": architecture, "config": config}, "deepspeed": deepspeed_section}

    def issue(path, message, hint=None, key=False):
        assert message and isinstance(path, tuple)
        return (path, message, hint)
    freeform.model_config_issues(spec, issue, {"model_type": "bert", "x": 1})
    freeform.deepspeed_issues(spec, issue)


# ---------------------------------------------------------------- the owned-keys table is honest

def _schema_has(path: tuple) -> bool:
    node = freeform.load_table(freeform.DEEPSPEED_SCHEMA)
    for key in path:
        branches = [node] + node.get("anyOf", [])
        node = next((b["properties"][key] for b in branches if key in b.get("properties", {})), None)
        if node is None:
            return False
    return True


def test_owned_keys_exist_in_deepspeed_and_their_fields_in_the_spec():
    for path, field in OWNED_DEEPSPEED_KEYS.items():
        assert _schema_has(path), path
        assert subschema_at(field.split(".")) is not None, field


def test_spec_reference_lists_exactly_the_owned_keys():
    description = load_schema()["properties"]["deepspeed"]["description"]
    listed = description.split("Keys a spec field sets are refused with that field:")[1].split("Other keys")[0]
    assert set(re.findall(r"`([a-z0-9_.]+)`", listed)) == {".".join(p) for p in OWNED_DEEPSPEED_KEYS}


def test_compiler_writes_every_owned_key_but_deepspeeds_aliases():
    """The compiler writes each owned key DeepSpeed reads directly, for the right spec."""
    sweep = [{"zero_stage": 3, "precision": "fp16", "offload": {"optimizer": "cpu", "params": "nvme",
                                                                "nvme_path": "/tmp"}},
             {"zero_stage": 2, "precision": "bf16"}]
    written = set()
    for memory in sweep:
        spec = load_and_validate_dict({**TINY, "memory": memory})
        config = compile_spec(spec, derive_job(spec)).ds_config
        written |= {path for path in OWNED_DEEPSPEED_KEYS if _get(config, path) is not None}
    aliases = {("zero_optimization", "cpu_offload"), ("zero_optimization", "cpu_offload_param"),
               ("zero_optimization", "prefetch_bucket_size"), ("zero_optimization", "param_persistence_threshold"),
               ("bfloat16", "enabled"), ("torch_autocast", "enabled")}
    assert written == set(OWNED_DEEPSPEED_KEYS) - aliases


def test_owned_aliases_do_what_the_table_says(monkeypatch):
    """DeepSpeed's own parser: the alias keys change the device or precision their field owns."""
    pytest.importorskip("deepspeed")
    from deepspeed import comm
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
    base = {"train_micro_batch_size_per_gpu": 1}
    zero = DeepSpeedConfig({**base, "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}})
    assert (zero.zero_config.offload_optimizer.device, zero.zero_config.offload_param.device) == ("cpu", "cpu")
    by_name = DeepSpeedConfig({**base, "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7,
                                                             "param_persistence_threshold": 9}}).zero_config
    assert (by_name.prefetch_bucket_size, by_name.param_persistence_threshold) == (7, 9)
    assert DeepSpeedConfig({**base, "bfloat16": {"enabled": True}}).bfloat16_config.enabled
    assert DeepSpeedConfig({**base, "torch_autocast": {"enabled": True}}).torch_autocast_enabled


@pytest.mark.parametrize("job", SHIPPED_JOBS, ids=lambda p: p.name)
def test_shipped_jobs_validate_and_their_compiled_config_fits_the_schema(job):
    resolved = load_and_validate(job)
    config = compile_spec(resolved.spec, derive_job(resolved.spec)).ds_config
    assert deepspeed_problems(config, owned=False) == []


def test_every_compiled_variant_fits_the_schema():
    for memory in ({"zero_stage": 0}, {"zero_stage": 1, "precision": "bf16"},
                   {"zero_stage": 2, "precision": "fp16", "offload": {"optimizer": "cpu"}},
                   {"zero_stage": 3, "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": "/tmp"}}):
        client_ok = memory.get("offload", {}).get("optimizer", "none") == "none"
        for optimizer in ("adamw", "sgd") + (("adafactor",) if client_ok else ()):
            spec = load_and_validate_dict({**TINY, "memory": memory, "training": {
                "max_steps": 2, "optimizer": {"name": optimizer}}})
            config = compile_spec(spec, derive_job(spec)).ds_config
            assert deepspeed_problems(config, owned=False) == [], (memory, optimizer)


def load_and_validate_dict(spec: dict) -> dict:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        return load_and_validate(write(Path(tmp), spec)).spec


def _get(config: dict, path: tuple):
    for key in path:
        if not isinstance(config, dict) or key not in config:
            return None
        config = config[key]
    return config


# ---------------------------------------------------------------- generated tables: fresh and light

def test_deepspeed_schema_is_up_to_date(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    out = tmp_path / "deepspeed-config.schema.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_deepspeed_schema.py"), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # The library's version is recorded for the reader, not compared: a fresh environment takes the
    # newest release within pyproject's range, and a release that changes no field leaves the table valid.
    fresh, ours = (_without_versions(json.loads(p.read_text())) for p in (out, REPO / "schemas" / out.name))
    assert fresh == ours, "schemas/deepspeed-config.schema.json is stale: run `python scripts/gen_deepspeed_schema.py`"


# The transformers table: every model type's config keys are regenerated (no model is built: ~15 s),
# and the module names (a meta build per head, ~80 s for all 800+ types) for a sample: the types of
# the shipped jobs and a few more of each kind (encoder, decoder, MoE, a head-less type). The keys of
# every type are what a transformers upgrade changes most; a module rename in a type outside the
# sample is still caught by plan/compile/--dry-run's meta build (model/lora.check_targets).
MODULE_SAMPLE = ["bert", "gpt2", "llama", "qwen2", "gemma2", "phi3", "xlm-roberta", "mistral", "mixtral", "t5",
                 "mlp", "clip"]
TABLE = REPO / "schemas" / "transformers-configs"


def test_transformers_table_is_up_to_date(tmp_path):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    script = str(REPO / "scripts" / "gen_transformers_configs.py")
    for args in (["--configs-only"], ["--only", *MODULE_SAMPLE]):
        out = tmp_path / args[0]
        done = subprocess.run([sys.executable, script, "--out", str(out), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        fresh = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
        assert _without_versions(fresh.pop("index.json")) == _without_versions(json.loads((TABLE / "index.json").read_text())), \
            "schemas/transformers-configs/index.json is stale: run `python scripts/gen_transformers_configs.py`"
        if args[0] == "--configs-only":
            assert len(fresh) == len(list(TABLE.glob("*.json"))) - 1   # every type, and no file of a dropped one
        for name, content in fresh.items():
            shipped = json.loads((TABLE / name).read_text())
            if args[0] == "--configs-only":
                shipped, content = ({k: v for k, v in c.items() if k not in ("heads", "positions")}
                                    for c in (shipped, content))
            assert content == shipped, f"schemas/transformers-configs/{name} is stale: run " \
                                       "`python scripts/gen_transformers_configs.py`"


def _without_versions(table: dict) -> dict:
    return {key: value for key, value in table.items() if key not in ("transformers_version", "x-deepspeed-version")}


def test_a_changed_field_makes_the_table_stale():
    """The comparison above would catch a real change (guards `_without_versions` dropping too much)."""
    table = json.loads((TABLE / "index.json").read_text())
    changed = json.loads(json.dumps(table))
    changed["common"].pop("vocab_size", None) or changed["model_types"].pop()
    assert _without_versions(changed) != _without_versions(table)
    assert _without_versions({**table, "transformers_version": "0"}) == _without_versions(table)


def test_table_covers_every_model_type_transformers_registers():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from jobspec.spec import model_table
    assert set(model_table.model_types()) == set(CONFIG_MAPPING_NAMES) | set(ARCHITECTURE_DEFAULTS)
    assert {p.stem for p in TABLE.glob("*.json")} == set(model_table.model_types()) | {"index"}


def test_pyproject_ships_both_tables():
    text = (REPO / "pyproject.toml").read_text()
    assert f'"schemas/{freeform.DEEPSPEED_SCHEMA}" = "jobspec/_schemas/{freeform.DEEPSPEED_SCHEMA}"' in text
    assert '"schemas/transformers-configs" = "jobspec/_schemas/transformers-configs"' in text


def test_validate_with_both_blocks_imports_no_heavy_library(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "bert", "custom": 1}))
    good = write(tmp_path, {**TINY, "memory": {"zero_stage": 2},
                            "deepspeed": {"zero_optimization": {"overlap_comm": False}, "flops_profiler": {}}})
    bad = write(tmp_path, {**TINY, "model": {"name_or_path": "ckpt", "config": {"hiddne_size": 1}},
                           "deepspeed": {"gradient_clippping": 1}}, "bad.yaml")
    code = ("import sys; from jobspec.cli import main; "
            f"codes = [main(['validate', {str(good)!r}]), main(['validate', {str(bad)!r}])]; "
            "heavy = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]; "
            "print(codes, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[0, 2] []", out.stdout + out.stderr
