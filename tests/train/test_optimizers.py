"""Each client optimizer is built from exactly the args its module's `client_args` writes from the resolved
spec, as the ranks compute them (jobspec/optimizers, train/patches.client_optimizer)."""
from __future__ import annotations

import json

import pytest

from jobspec import optimizers
from jobspec.compile.compiler import compile_spec
from jobspec.spec.derived import derive
from jobspec.spec.schema import fill_defaults
from jobspec.train.patches import build_client_optimizer


def tiny_model(arch: str = "bert"):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(arch, num_labels=3, pad_token_id=0, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, vocab_size=200,
                                  max_position_embeddings=64)
    return AutoModelForSequenceClassification.from_config(config)


def patch_args(optimizer: dict) -> dict:
    """The client optimizer's args as the ranks compute them from the resolved spec (resolved.yaml, here a
    JSON round trip), with no `client_optimizer` patch in the compiled patches."""
    spec = fill_defaults({"model": {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2,
                                                                        "num_attention_heads": 4, "vocab_size": 1000}},
                          "data": {"synthetic": {"num_samples": 100}},
                          "training": {"max_steps": 10, "optimizer": optimizer}})
    assert not [p for p in compile_spec(spec, derive(spec)).patches if p["name"] == "client_optimizer"]
    section = json.loads(json.dumps(spec["training"]["optimizer"]))
    return optimizers.get(section["name"]).client_args(section)


def as_written(defaults: dict) -> dict:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in defaults.items()}


def test_adafactor_receives_exactly_the_patch_args():
    args = patch_args({"name": "adafactor", "lr": 3e-4, "weight_decay": 0.01})
    optimizer = build_client_optimizer(tiny_model("bert"), args)
    assert as_written(optimizer.defaults) == {k: v for k, v in args.items() if k != "name"}


def test_adafactor_args_edited_in_patches_json_are_the_ones_that_run():
    # not Adafactor's defaults: a value the builder dropped would show here
    args = {**patch_args({"name": "adafactor"}), "eps": [1e-29, 1e-2], "clip_threshold": 2.0, "decay_rate": -0.5}
    optimizer = build_client_optimizer(tiny_model("bert"), args)
    assert optimizer.defaults["eps"] == (1e-29, 1e-2)
    assert optimizer.defaults["clip_threshold"] == 2.0 and optimizer.defaults["decay_rate"] == -0.5
    assert as_written(optimizer.defaults) == {k: v for k, v in args.items() if k != "name"}


def test_adamw_8bit_receives_exactly_the_patch_args():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    args = patch_args({"name": "adamw_8bit", "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7})
    optimizer = build_client_optimizer(tiny_model("bert"), args)
    for key in ("lr", "eps"):
        assert optimizer.defaults[key] == args[key]
    assert list(optimizer.defaults["betas"]) == args["betas"]
