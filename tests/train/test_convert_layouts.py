"""`jobspec export` on the checkpoint layouts of DeepSpeed's optimizers, built in this process on 1 rank.

The 2-rank launches (test_export.py) cover ZeRO-2 and ZeRO-3 across ranks; here the optimizer
wrappers that change the file layout: ZeRO-0 (FP16_Optimizer under bf16: the module in
mp_rank_00), ZeRO-1 (DeepSpeedZeroOptimizer), BF16_Optimizer (ZeRO-1 with fp32 gradient
accumulation: fp32 partitions without the `zero_stage` key zero_to_fp32 looks for). Reference: the
live engine's own weights (its fp32 masters through `safe_get_full_fp32_param` where it has them).
"""
from __future__ import annotations

import os
import socket

import pytest
import split_runs
import torch
import yaml

from jobspec.spec.schema import fill_defaults

pytestmark = pytest.mark.slow   # an in-process DeepSpeed engine: imports and op builds take a while

BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "vocab_size": 300, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def one_rank():
    import torch.distributed as dist
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with split_runs.without_unused_ops():
        yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("stage, precision, extra, wrapper", [
    (0, "bf16", {}, "FP16_UnfusedOptimizer"),   # torch.optim.AdamW; a fused Adam gets FP16_Optimizer
    (1, "fp32", {}, "DeepSpeedZeroOptimizer"),
    (1, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}, "BF16_Optimizer"),
])
def test_every_optimizer_layout_converts_to_the_engines_weights(tmp_path, one_rank, stage, precision, extra,
                                                                  wrapper):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from jobspec.export.from_checkpoint import export_checkpoint, locate
    from jobspec.model.build import build_model
    spec = fill_defaults({"name": "layouts", "model": {"architecture": "bert", "config": BERT,
                                                       "task": "token-classification"},
                          "data": {"synthetic": {"vocab_range": [5, 300], "seq_len": 16}},
                          "training": {"max_steps": 2}, "memory": {"precision": precision, "zero_stage": stage}})
    spec["output_dir"], spec["checkpoint"]["dir"] = str(tmp_path / "out"), str(tmp_path / "ckpt")
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "bf16": {"enabled": precision == "bf16"}, "zero_optimization": {"stage": stage},
              "steps_per_print": 10**9, **extra}
    model = build_model(spec)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert type(engine.optimizer).__name__ == wrapper
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):   # weights move away from the initialisation, masters away from bf16 values
        ids = torch.randint(5, 300, (2, 16), generator=generator)
        engine.backward(engine(input_ids=ids, labels=torch.randint(0, 2, (2, 16), generator=generator)).loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="step2", client_state={"step": 2, "zero_stage": stage})
    (tmp_path / "ckpt" / "step2" / "jobspec_resolved.yaml").write_text(yaml.safe_dump(spec))

    record = export_checkpoint(locate(tmp_path / "ckpt" / "step2"), tmp_path / "m", "fp32", show_progress=False)
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "m" / "model.safetensors")
    for name, param in engine.module.named_parameters():
        master = safe_get_full_fp32_param(param)
        expected = (master if master is not None else param.detach().float()).reshape(param.shape)
        assert torch.equal(saved[name], expected.cpu()), name
    masters_exist = stage > 0
    assert bool(record["notes"]) is not masters_exist   # ZeRO-0 says its 16-bit weights were saved
    if precision == "bf16" and masters_exist:
        assert any((t != t.bfloat16().float()).any() for t in saved.values())
