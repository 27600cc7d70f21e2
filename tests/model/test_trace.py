"""jobspec.model.planner_trace: the model's inventory, the composed trace against the full one, errors, the cache.

The full trace runs every layer of the model with the training patch itself (transformers'
gradient_checkpointing_enable, or jobspec's one-in-k wrapper); the composed one traces units of at
most three layers (`memory.model_profile.compose`). They must agree exactly, peak and regions, for
uniform stacks, alternating local/global attention (gemma2's layer_types), grouped-query attention,
tied and untied heads and every checkpointing pattern the fit search tries.
"""
from __future__ import annotations

import json
import re

import pytest

from jobspec.errors import SpecError
from jobspec.model.build import build_model
from jobspec.model.planner_trace import ModelTracer, job_profiler, model_key
from jobspec.spec.schema import fill_defaults
from jobspec.memory.model_profile import PHASES

LLAMA = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 172, "vocab_size": 2000, "max_position_embeddings": 128,
         "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
GEMMA2 = {**LLAMA, "num_hidden_layers": 7, "head_dim": 8, "sliding_window": 16}   # S F S F S F S: the units need an F
BERT = {"hidden_size": 48, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 192,
        "vocab_size": 3000, "max_position_embeddings": 128}
GPT2 = {"n_embd": 32, "n_layer": 6, "n_head": 4, "vocab_size": 2000, "n_positions": 128}

# one xdist worker runs the whole module: its cases share the in-process tracers of `shared_tracer`
pytestmark = pytest.mark.xdist_group("model-tracers")


def spec_for(architecture, task="causal-lm", config=None, attention="eager", freeze=(), num_labels=2):
    # a resolved spec has every default filled: the ranks and the tracer index it
    return fill_defaults({"model": {"architecture": architecture, "task": task, "num_labels": num_labels,
                      "config": dict(config or {}), "attention": attention, "freeze": list(freeze)},
            "training": {"seed": 0, "micro_batch_size": 2}, "data": {},
            "memory": {"precision": "bf16", "activation_checkpointing": False}})


SETTINGS = [False, True, {"every_n_layers": 2}, {"every_n_layers": 3}, {"every_n_layers": 4}]
_TRACERS: dict = {}


def shared_tracer(architecture, task="causal-lm", config=None, attention="eager"):
    """One tracer per model for the whole module: its in-process cache keeps the unit traces, which the
    checkpointing settings of one model largely share (every4's units of a 6-layer stack are every2's),
    so each case costs its full trace and its new units only. Traces are deterministic: a shared unit is
    the one the case would have traced itself."""
    key = json.dumps([architecture, task, config, attention], sort_keys=True)
    if key not in _TRACERS:
        _TRACERS[key] = ModelTracer(spec_for(architecture, task, config, attention))
    return _TRACERS[key]


@pytest.mark.parametrize("checkpointing", SETTINGS, ids=["off", "every1", "every2", "every3", "every4"])
@pytest.mark.parametrize("architecture, task, config, attention, precision", [
    ("llama", "causal-lm", LLAMA, "sdpa", "bf16"),                       # GQA, untied head, stand-in kernel
    ("gemma2", "causal-lm", GEMMA2, "eager", "bf16"),                    # alternating sliding/global layers
    ("bert", "sequence-classification", BERT, "eager", "fp32"),          # post-LN encoder, dropout masks
    ("gpt2", "causal-lm", GPT2, "sdpa", "fp16"),                         # tied head
    ("deberta-v2", "sequence-classification",                            # relative positions shared by layers
     {**BERT, "relative_attention": True, "pos_att_type": ["p2c", "c2p"]}, "eager", "fp16"),
], ids=["llama-sdpa", "gemma2-eager", "bert-eager", "gpt2-sdpa", "deberta-relative"])
def test_the_composed_trace_equals_the_full_trace(architecture, task, config, attention, precision, checkpointing):
    tracer = shared_tracer(architecture, task, config, attention)
    if architecture == "gemma2":
        assert tracer.inventory().layer_kinds[:2] == ("sliding_attention", "full_attention")
    # 5: every unit's timeline extrapolated from micro-batches 1 and 2 (checked on two settings: time)
    for micro_batch in (2, 5) if checkpointing in (False, {"every_n_layers": 3}) else (2,):
        composed = tracer.profile(precision, micro_batch, 64, checkpointing)
        full = tracer.full(precision, micro_batch, 64, checkpointing)
        assert composed.method == "composed"
        # the peak, every region at the peak and the FLOPs, to the byte
        assert (composed.activations.peak, composed.activations.regions, composed.activations.flops) == \
            (full.peak, full.regions, full.flops)
        # and with every gradient kept as it is made (a ZeRO-0 step of one micro-batch; the planner
        # uses it for stacks whose layers are alike: every layer checkpointed, or none)
        if checkpointing in (False, True):
            kept, kept_full = composed.activations.with_gradients(), full.with_gradients()
            assert (kept.peak, kept.regions) == (kept_full.peak, kept_full.regions)


def test_checkpointing_and_sequence_length_move_the_trace_as_they_should():
    tracer = shared_tracer("llama", config=LLAMA, attention="sdpa")
    off = tracer.profile("bf16", 2, 64, False).activations
    every = tracer.profile("bf16", 2, 64, True).activations
    longer = tracer.profile("bf16", 2, 128, False).activations
    double_batch = tracer.profile("bf16", 4, 64, False).activations
    assert every.regions["layers"] < off.regions["layers"] / 2
    assert every.regions["logits_and_loss"] == off.regions["logits_and_loss"]
    assert every.flops > off.flops                      # the recompute
    assert 1.8 < double_batch.peak / off.peak <= 2.0    # activations scale with the batch (ids, masks...)
    assert longer.peak > 1.9 * off.peak
    assert sum(off.regions.values()) == off.peak


def test_eager_attention_keeps_the_scores_and_the_kernels_do_not():
    eager = ModelTracer(spec_for("llama", config=LLAMA, attention="eager")).profile("bf16", 2, 128, False)
    sdpa = shared_tracer("llama", config=LLAMA, attention="sdpa").profile("bf16", 2, 128, False)
    heads, layers = LLAMA["num_attention_heads"], LLAMA["num_hidden_layers"]
    scores = 2 * heads * 128 * 128 * layers            # batch x heads x s x s, per layer, at least 1 byte each
    assert eager.activations.regions["layers"] - sdpa.activations.regions["layers"] > scores


@pytest.mark.parametrize("architecture, task, config", [
    ("llama", "causal-lm", LLAMA),
    ("llama", "causal-lm", {**LLAMA, "tie_word_embeddings": True}),
    ("gpt2", "causal-lm", GPT2),
    ("gemma2", "causal-lm", GEMMA2),
    ("bert", "sequence-classification", BERT),
    ("deberta-v2", "sequence-classification", {**BERT, "relative_attention": True, "pos_att_type": ["p2c", "c2p"]}),
    ("mlp", "sequence-classification", {"hidden_size": 64, "num_layers": 3, "vocab_size": 500}),
])
def test_the_inventory_counts_the_model_training_builds(architecture, task, config):
    spec = spec_for(architecture, task, config)
    model = build_model(spec)
    inventory = ModelTracer(spec).inventory()
    assert inventory.total == sum(p.numel() for p in model.parameters())   # tied weights once
    assert [name for name, _, _ in inventory.tensors] == [name for name, _ in model.named_parameters()]
    assert inventory.buffer_float_elements + inventory.buffer_other_bytes >= 0
    assert inventory.num_layers == config.get("num_hidden_layers", config.get("n_layer", config.get("num_layers")))
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in
                __import__("jobspec.model.structure", fromlist=["x"]).find_layer_stack(model))
    assert inventory.layer_params == layer


def test_frozen_parameters_are_not_trainable_in_the_inventory():
    spec = spec_for("bert", "sequence-classification", BERT, freeze=["embeddings.*", "encoder.layer.0.*"])
    model = build_model(spec)
    inventory = ModelTracer(spec).inventory()
    frozen = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("bert.embeddings.",
                                                                                    "bert.encoder.layer.0.")))
    assert inventory.frozen == frozen and inventory.trainable == inventory.total - frozen


def test_a_mixture_of_experts_is_refused_by_name():
    config = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 64, "vocab_size": 500, "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(SpecError, match="'mixtral' routes each token to 4 experts") as err:
        ModelTracer(spec_for("mixtral", config=config)).profile("bf16", 1, 16, False)
    assert err.value.issues[0].path == ("model",)


@pytest.mark.parametrize("architecture, config, path, needle", [
    ("llamma", {}, ("model", "architecture"), "did you mean llama"),
    ("llama", {**LLAMA, "hidden_size": 60}, ("model", "config"), "hidden size (60) is not a multiple"),
])
def test_a_model_that_cannot_be_built_is_a_positioned_one_line_error(architecture, config, path, needle):
    with pytest.raises(SpecError) as err:
        ModelTracer(spec_for(architecture, config=config)).profile("bf16", 1, 16, False)
    issue = err.value.issues[0]
    assert issue.path == path and needle in str(err.value) and "\n" not in issue.message


def test_the_disk_cache_answers_without_tracing_and_keys_on_what_changes_a_trace(tmp_path, monkeypatch):
    spec = spec_for("llama", config={**LLAMA, "num_hidden_layers": 3}, attention="sdpa")
    first = ModelTracer(spec, tmp_path).profile("bf16", 2, 32, True)
    from jobspec.model import planner_trace

    def no_tracing(*_a, **_k):
        raise AssertionError("traced although cached")

    monkeypatch.setattr(planner_trace.ModelTracer, "_trace", no_tracing)
    monkeypatch.setattr(planner_trace.ModelTracer, "_build", no_tracing)
    again = ModelTracer(spec, tmp_path).profile("bf16", 2, 32, True)
    assert again == first
    with pytest.raises(AssertionError, match="traced although cached"):
        ModelTracer(spec, tmp_path).profile("bf16", 2, 64, True)       # another sequence length
    other = spec_for("llama", config={**LLAMA, "num_hidden_layers": 3}, attention="eager")
    assert model_key(other) != model_key(spec)


def test_a_damaged_cache_entry_is_traced_again(tmp_path):
    spec = spec_for("gpt2", config={**GPT2, "n_layer": 2})
    good = ModelTracer(spec, tmp_path).profile("fp32", 1, 16, False)
    for path in tmp_path.rglob("*.json"):
        path.write_text("{not json")
    assert ModelTracer(spec, tmp_path).profile("fp32", 1, 16, False) == good


def test_concurrent_launches_leave_whole_entries(tmp_path):
    """Two processes tracing the same model into one cache at once (two launches of a sweep): both get
    the same plan and every entry is whole JSON afterwards (written to a temporary file, then renamed)."""
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from jobspec.model.planner_trace import ModelTracer\n"
        f"spec = {spec_for('gpt2', config={**GPT2, 'n_layer': 4})!r}\n"
        "p = ModelTracer(spec, __import__('pathlib').Path(sys.argv[1])).profile('fp32', 1, 16, {'every_n_layers': 2})\n"
        "print(p.activations.peak)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1] and outs[0].isdigit()
    entries = list(tmp_path.rglob("*.json"))
    assert entries and all(json.loads(p.read_text()) for p in entries)
    assert not list(tmp_path.rglob(".tmp-*"))


def test_the_job_profiler_reads_the_spec_setting(tmp_path):
    spec = spec_for("gpt2", config={**GPT2, "n_layer": 2})
    # a resolved memory section (every field filled, as the loader leaves it)
    memory = {"precision": "fp32", "activation_checkpointing": {"every_n_layers": 1}}
    spec["memory"] = fill_defaults({"memory": memory})["memory"]
    profile = job_profiler(tmp_path)(spec, 16)
    assert profile == ModelTracer(spec, tmp_path).profile("fp32", 2, 16, {"every_n_layers": 1})


# Published parameter counts (the models' cards), with their released configs: the inventory is the
# model transformers builds, so these hold for any architecture, not only the ones jobspec knew.
PUBLISHED = [
    ("qwen2", "sdpa", {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                       "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
                       "tie_word_embeddings": True, "pad_token_id": 151643, "bos_token_id": 151643,
                       "eos_token_id": 151645}, 494_032_768),                        # Qwen2.5-0.5B
    ("gemma2", "eager", {"hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
                         "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216,
                         "vocab_size": 256000, "max_position_embeddings": 8192}, 2_614_341_888),   # gemma-2-2b
    ("phi3", "sdpa", {"hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
                      "max_position_embeddings": 4096, "pad_token_id": 32000, "bos_token_id": 1,
                      "eos_token_id": 32000}, 3_821_079_552),                        # Phi-3-mini-4k
    ("llama", "sdpa", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                       "max_position_embeddings": 8192, "tie_word_embeddings": False, "pad_token_id": 0,
                       "bos_token_id": 128000, "eos_token_id": 128001}, 8_030_261_248),   # Llama-3-8B
]


@pytest.mark.parametrize("architecture, attention, config, published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_the_inventory_matches_published_parameter_counts(architecture, attention, config, published):
    assert ModelTracer(spec_for(architecture, config=config, attention=attention)).inventory().total == published


def test_jobspec_plan_plans_a_qwen2_job_from_its_own_code(tmp_path, capsys):
    """The issue's new user: a Qwen2 job validates, compiles and launches; `jobspec plan` plans it too."""
    import yaml

    from jobspec.cli import main

    _, _, config, published = PUBLISHED[0]
    job = tmp_path / "qwen2.yaml"
    job.write_text(yaml.safe_dump({
        "name": "qwen2-sft", "model": {"architecture": "qwen2", "task": "causal-lm", "config": config},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 1024, "vocab_range": [100, 150000]}},
        "training": {"max_steps": 10, "micro_batch_size": 4},
        "memory": {"precision": "bf16", "activation_checkpointing": True}}))
    assert main(["plan", str(job), "--format", "json", "--gpu-mem", "24GiB"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["settings"]["parameters"] == published and plan["settings"]["trace"] == "composed"
    assert plan["breakdown"]["logits_and_loss"] > 4 * 1024 * 151936 * 4   # fp32 logits over a 152k vocabulary
    assert plan["compute"]["hardware_flops_per_token"] > plan["compute"]["model_flops_per_token"] > 6 * 0.3e9


def test_the_composition_follows_the_peak_from_one_phase_to_another():
    """A large vocabulary on a small hidden size, every layer checkpointed: with a small batch the step's
    peak is the embedding table's gradient in flight (the embeddings' backward, when no layer keeps
    anything), with a large one it is inside the layer stack. The short units peak in the first place
    even when the whole model peaks in the second; the composition adds the layers' increments to the
    stack's and the turn's peaks only, and takes the highest phase."""
    config = {**BERT, "vocab_size": 30000, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
              "num_hidden_layers": 16}
    tracer = ModelTracer(spec_for("xlm-roberta", "sequence-classification", config, "eager"))
    phases = {}
    for micro_batch in (1, 9):
        composed = tracer.profile("fp16", micro_batch, 64, True).activations
        full = tracer.full("fp16", micro_batch, 64, True)
        assert (composed.peak, composed.regions) == (full.peak, full.regions)
        phases[micro_batch] = max(PHASES, key=lambda name: full.phases[name].peak)
        unit_phase = tracer.unit("fp16", micro_batch, 64, (("layer", True),) * 3).phases
        phases[micro_batch, "unit"] = max(PHASES, key=lambda name: unit_phase[name].peak)
    assert phases[1] == "outside" and phases[9] == "stack" and phases[9, "unit"] == "outside"


def test_a_model_the_planner_refuses_still_launches_and_the_header_says_why(tmp_path, capsys):
    """Item 7: `jobspec plan` refuses a mixture of experts at its line (exit 2); `jobspec launch` does
    not stop for a plan it cannot make: the header says there is no plan, and the line above says why."""
    import yaml

    from jobspec.cli import main

    job = tmp_path / "moe.yaml"
    job.write_text(yaml.safe_dump({
        "name": "moe", "model": {"architecture": "mixtral", "task": "causal-lm", "config": {
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "vocab_size": 500, "num_local_experts": 4, "num_experts_per_tok": 2}},
        "data": {"synthetic": {"num_samples": 64, "seq_len": 32, "vocab_range": [5, 500]}},
        "training": {"max_steps": 2, "micro_batch_size": 4}, "resources": {"gpus_per_node": 1},
        "output_dir": str(tmp_path / "out"), "logging": {"mlflow": {"enabled": False}}}, sort_keys=False))
    assert main(["plan", str(job)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(job))}:\d+:\d+: model: model type 'mixtral' routes each token to 4 experts", err)
    assert "Traceback" not in err
    assert main(["launch", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory plan unavailable (model type 'mixtral' routes" in out and "no plan for this model" in out
    assert not (tmp_path / "out").exists()
