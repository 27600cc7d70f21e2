"""model/construct.py: the construction a compiled DeepSpeed config asks for (training dtype, ZeRO-3
partitioned), and build_model honouring it. The 2-rank launch is tests/train/test_zero_init.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO_ROOT, free_port
from spec_builder import build_spec, replace

from jobspec.model.build import build_model
from jobspec.model.construct import FP32, construction_for, count_partitions

LLAMA = {"architecture": "llama", "task": "causal-lm",
         "config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}}
MLP = {"architecture": "mlp", "task": "sequence-classification",
       "config": {"hidden_size": 16, "num_layers": 3, "vocab_size": 128}}


def spec_of(model: dict) -> dict:
    """TINY_SPEC with `model` (its config whole, not merged into the tiny BERT's)."""
    return build_spec(model={**model, "num_labels": 2, "config": replace(model["config"])})


def ds(stage: int, precision: str) -> dict:
    return {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
            "zero_optimization": {"stage": stage}}


@pytest.mark.parametrize("config, precision, zero3", [
    (ds(0, "fp32"), "fp32", False), (ds(2, "bf16"), "bf16", False), (ds(1, "fp16"), "fp16", False),
    (ds(3, "bf16"), "bf16", True), (ds(3, "fp32"), "fp32", True), (None, "fp32", False), ({}, "fp32", False),
])
def test_construction_follows_the_compiled_config(config, precision, zero3):
    construction = construction_for(config)
    assert (construction.precision, construction.zero3) == (precision, zero3)
    assert construction.ds_config is (config if zero3 else None)   # zero.Init reads exactly the compiled config


def test_unpartitioned_parameters_count_whole():
    model = torch.nn.Linear(4, 3)
    parts = count_partitions(model)
    assert (parts.held, parts.total, parts.partitioned, parts.fraction) == (15, 15, False, 1.0)
    assert FP32.describe() == "a full copy per rank, in fp32"


@pytest.mark.parametrize("model", [LLAMA, MLP], ids=["llama", "mlp"])
def test_zero0_bf16_builds_straight_in_bf16(model):
    """No fp32 copy first: the parameters are born bf16 and the default dtype is restored after."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    built = build_model(spec_of(model), ds_config=ds(0, "bf16"))
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert not is_deepspeed_zero3_enabled()
    assert count_partitions(built).partitioned is False


def test_without_a_ds_config_the_build_is_unchanged():
    assert {p.dtype for p in build_model(spec_of(LLAMA)).parameters()} == {torch.float32}


ZERO3_SCRIPT = textwrap.dedent("""
    import json, sys, torch, deepspeed
    from jobspec.model.build import build_model
    from jobspec.model.construct import count_partitions
    from transformers.integrations import is_deepspeed_zero3_enabled
    from jobspec import ops
    ops.skip_unused_ops()   # as the worker: DeepSpeed's shm all-reduce op (minutes to build on a new machine)
    deepspeed.init_distributed(dist_backend="gloo")
    specs, config = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    out = {}
    for name, spec in specs.items():
        model = build_model(spec, ds_config=config)
        parts = count_partitions(model)
        out[name] = {"held": parts.held, "total": parts.total, "partitioned": parts.partitioned,
                     "dtypes": sorted({str(p.ds_tensor.dtype) for p in model.parameters()}),
                     "numel": sum(p.numel() for p in model.parameters()),
                     "hf_zero3": is_deepspeed_zero3_enabled()}
    from jobspec.model.build import build_skeleton
    skeleton = build_skeleton(specs["llama"])   # an export's, on one rank: never partitioned
    out["skeleton"] = {"partitioned": count_partitions(skeleton).partitioned, "hf_zero3": is_deepspeed_zero3_enabled()}
    unpartitioned = build_model(specs["llama"], ds_config={**config, "zero_optimization": {"stage": 2}})
    out["after"] = {"hf_zero3": is_deepspeed_zero3_enabled(),
                    "partitioned": count_partitions(unpartitioned).partitioned}
    print("RESULT " + json.dumps(out))
""")


def test_zero3_builds_under_zero_init_one_rank():
    """World size 1 (one process): every parameter is a zero.Init placeholder, its partition holds
    all of it, in the training dtype; a later ZeRO-2 build in the same process is not partitioned."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    specs = {"llama": spec_of(LLAMA), "mlp": spec_of(MLP)}
    proc = subprocess.run([sys.executable, "-c", ZERO3_SCRIPT, json.dumps(specs), json.dumps(ds(3, "bf16"))],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    for name in ("llama", "mlp"):
        got = out[name]
        assert got["partitioned"] and got["held"] == got["total"] > 0, got
        assert got["numel"] == 0            # placeholders until DeepSpeed gathers them
        assert got["dtypes"] == ["torch.bfloat16"]
    assert out["llama"]["hf_zero3"] is True
    assert out["skeleton"] == {"partitioned": False, "hf_zero3": True}   # and the ZeRO-3 config is back
    assert out["after"] == {"hf_zero3": False, "partitioned": False}


def test_the_skeleton_of_jobspecs_mlp_imports_no_transformers(tmp_path):
    """build_skeleton of the MLP (a plan's inventory, an export) leaves transformers alone: no
    ZeRO-3 config of transformers' can be live where transformers was never imported."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_of(MLP)))
    code = ("import json, sys\nfrom jobspec.model.build import build_skeleton\n"
            "model = build_skeleton(json.loads(open(sys.argv[1]).read()))\n"
            "print(sum(p.numel() for p in model.parameters()), 'transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    count, imported = done.stdout.split()
    assert int(count) > 0 and imported == "False"


# --- on the rank's device (construct.rank_device); QLoRA's base made and quantised layer by layer ---

LLAMA_64 = {"architecture": "llama", "task": "causal-lm",
            "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64}}
QLORA = {"lora": {"r": 4, "alpha": 8}, "quantization": {"bits": 4}}


def from_config(spec: dict, dtype):
    """transformers' own build of the spec's model, seeded as the ranks seed it."""
    from jobspec.model.build import build_config

    auto_class, config = build_config(spec)
    torch.manual_seed(spec["training"]["seed"])
    return auto_class.from_config(config, attn_implementation=spec["model"]["attention"], dtype=dtype)


def as_bytes(tensor):
    return tensor.contiguous().view(torch.uint8) if tensor.is_floating_point() else tensor


def differing(a, b) -> list[str]:
    """The state-dict keys whose tensors differ, compared byte for byte (bitsandbytes packs 4-bit
    weights into bf16-wide storage, whose bit patterns include NaNs)."""
    one, other = a.state_dict(), b.state_dict()
    assert set(one) == set(other)
    return [k for k in one if one[k].dtype != other[k].dtype or not torch.equal(as_bytes(one[k]), as_bytes(other[k]))]


def test_the_rank_device_is_its_gpu_else_the_cpu(monkeypatch):
    from jobspec.model.construct import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device() == torch.device("cuda", 3)


@pytest.mark.parametrize("model", [LLAMA, {"architecture": "bert", "task": "token-classification",
                                           "config": {"hidden_size": 32, "num_hidden_layers": 2,
                                                      "num_attention_heads": 2, "intermediate_size": 64,
                                                      "vocab_size": 128, "max_position_embeddings": 64}}],
                         ids=["llama", "bert"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_cpu_rank_builds_bit_for_bit_what_transformers_builds(model, precision):
    """A CPU rank's device is the CPU: its model is transformers' `from_config` in the training dtype,
    every parameter and buffer equal to the last bit (training results on CPU ranks unchanged)."""
    spec = spec_of(model)
    built = build_model(spec, ds_config=ds(0, precision))
    plain = from_config(spec, torch.bfloat16 if precision == "bf16" else torch.float32)
    assert differing(built, plain) == []
    assert {p.device for p in built.parameters()} == {torch.device("cpu")}


def test_a_gpu_rank_builds_under_its_device_and_only_there(monkeypatch):
    """Where the rank's device is not the CPU, `from_config` runs under it: every tensor is created
    there (here the meta device stands in for a GPU: nothing of the model on the host). Without a
    DeepSpeed config (export, tools) the model stays on the CPU."""
    from jobspec.model import construct

    monkeypatch.setattr(construct, "rank_device", lambda: torch.device("meta"))
    on_rank = build_model(spec_of(LLAMA), ds_config=ds(2, "bf16"))
    assert {t.device.type for t in [*on_rank.parameters(), *on_rank.buffers()]} == {"meta"}
    mlp = build_model(spec_of(MLP), ds_config=ds(1, "bf16"))
    assert {p.device.type for p in mlp.parameters()} == {"meta"}
    assert {p.device.type for p in build_model(spec_of(LLAMA)).parameters()} == {"cpu"}


def test_a_checkpoint_loads_onto_the_rank_device_unchanged(tmp_path, monkeypatch):
    """A CPU rank loads the checkpoint's tensors exactly; another device gets them straight (the meta
    device standing in for a GPU: no tensor of the model on the host)."""
    from jobspec.model import construct

    spec = spec_of(LLAMA)
    saved = from_config(spec, torch.float32)
    saved.save_pretrained(tmp_path / "ckpt")
    pretrained = build_spec(model={"name_or_path": str(tmp_path / "ckpt"), "architecture": None,
                                   "task": "causal-lm", "config": replace({})})
    assert differing(build_model(pretrained, ds_config=ds(0, "fp32")), saved) == []
    monkeypatch.setattr(construct, "rank_device", lambda: torch.device("meta"))
    elsewhere = build_model(pretrained, ds_config=ds(2, "bf16"))
    assert {p.device.type for p in elsewhere.parameters()} == {"meta"}


def qlora_spec(model: dict, seed: int = 7, **quantization) -> dict:
    return build_spec(model={**model, "num_labels": 2, "config": replace(model["config"]), **QLORA,
                             "quantization": {"bits": 4, **quantization}},
                      training={"seed": seed}, memory={"precision": "bf16"})


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_quantises_each_linear_as_drawn_with_the_draws_of_the_unquantised_build(bits):
    """The base made module by module (model/materialize) and each linear quantised as soon as it is
    drawn equals the same model made whole and quantised after (quantize_linears): the same draws,
    the same bitsandbytes layers, the same packed bytes; nothing left on meta."""
    from jobspec.model.build import build_config
    from jobspec.model.lora import quantization_config, quantized_linear_names
    from jobspec.model.materialize import materialize, skeleton
    from jobspec.model.quantize import quantize_linears

    spec = qlora_spec(LLAMA_64, bits=bits)
    built = build_model(spec, ds_config=ds(0, "bf16"))
    auto_class, config = build_config(spec)
    torch.manual_seed(spec["training"]["seed"])
    whole = materialize(skeleton(auto_class, config, dtype=torch.bfloat16), "cpu")
    names = quantized_linear_names(spec, whole)
    assert len(names) == 2 * 7
    quantize_linears(whole, quantization_config(spec, whole), names, torch.device("cpu"))
    assert differing(built, whole) == []
    layer = type(built.get_submodule(names[0])).__name__
    assert layer == ("Linear4bit" if bits == 4 else "Linear8bitLt")
    assert not any(t.is_meta for t in [*built.parameters(), *built.buffers()])
    assert built.config.quantization_config.load_in_4bit is (bits == 4)


def test_qlora_weights_follow_from_configs_distribution():
    """Dequantised, each 4-bit weight has the mean and std of transformers' draws for that tensor,
    within sampling error plus NF4's rounding; the unquantised tensors likewise, the rotary buffers
    equal."""
    import math

    from jobspec.model.quantize import dequantized_state_dict

    spec = qlora_spec(LLAMA_64)
    built = build_model(spec, ds_config=ds(0, "bf16"))
    ours = dequantized_state_dict(built, torch.float32)
    theirs = from_config(spec, torch.bfloat16).state_dict()
    for key, want in theirs.items():
        got, want = ours[key].float(), want.float()
        if float(want.std()) == 0.0:
            assert torch.equal(got, want), key
            continue
        n, s = want.numel(), float(want.std())
        assert abs(float(got.mean()) - float(want.mean())) <= 6 * s * math.sqrt(2 / n), key
        # NF4 rounds each value by up to half a level (16 levels over +-absmax of 64 values: ~0.1 s)
        assert abs(float(got.std()) - s) <= 6 * s / math.sqrt(n) + 0.05 * s, key
    assert torch.equal(built.model.rotary_emb.inv_freq, from_config(spec, torch.bfloat16).model.rotary_emb.inv_freq)


def test_qlora_keeps_tied_weights_tied_and_the_same_seed_builds_the_same_base():
    tied = {**LLAMA_64, "config": {**LLAMA_64["config"], "tie_word_embeddings": True}}
    first = build_model(qlora_spec(tied), ds_config=ds(0, "bf16"))
    assert first.lm_head.weight is first.model.embed_tokens.weight
    assert type(first.lm_head).__name__ == "Linear"   # the output embedding stays whole
    assert differing(first, build_model(qlora_spec(tied), ds_config=ds(0, "bf16"))) == []
    other = build_model(qlora_spec(tied, seed=8), ds_config=ds(0, "bf16"))
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


@pytest.mark.parametrize("model", [LLAMA_64, {"architecture": "gpt2", "task": "causal-lm",
                                              "config": {"n_embd": 64, "n_layer": 2, "n_head": 4,
                                                         "vocab_size": 128, "n_positions": 64}}],
                         ids=["llama", "gpt2-conv1d"])
def test_a_quantised_checkpoint_loads_the_layers_the_random_build_quantises(tmp_path, model):
    """From a checkpoint, transformers' bitsandbytes integration quantises exactly
    `quantized_linear_names` (GPT-2's Conv1D layers stay whole, as in a build from a config) and
    packs the same bytes as quantising the loaded 16-bit model afterwards."""
    from jobspec.model.lora import quantization_config, quantized_linear_names
    from jobspec.model.quantize import quantize_linears

    spec = qlora_spec(model)
    from_config(spec, torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    checkpoint = {"name_or_path": str(tmp_path / "ckpt"), "architecture": None, "task": "causal-lm",
                  "config": {}}
    loaded = build_model(qlora_spec(checkpoint), ds_config=ds(0, "bf16"))
    plain = build_model(build_spec(model={**checkpoint, "config": replace({})}, memory={"precision": "bf16"}),
                        ds_config=ds(0, "bf16"))
    names = quantized_linear_names(qlora_spec(checkpoint), plain)
    quantize_linears(plain, quantization_config(qlora_spec(checkpoint), plain), names, torch.device("cpu"))
    assert {n for n, m in loaded.named_modules() if type(m).__name__ == "Linear4bit"} == \
        {n for n in names if type(plain.get_submodule(n)).__name__ == "Linear4bit"}
    assert differing(loaded, plain) == []
