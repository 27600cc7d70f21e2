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
