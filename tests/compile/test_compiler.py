"""compile_spec: batch arithmetic, steps, optimizer/scheduler/precision/ZeRO blocks, patches, overrides."""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import math

import pytest
from spec_builder import build_spec

from jobspec import optimizers
from jobspec.compile.compiler import compile_spec, find_auto, patch_text
from jobspec.errors import SpecError
from jobspec.spec.derived import derive
from jobspec.spec.model_dims import model_dims
from jobspec.spec.schema import fill_defaults

TINY_MODEL = {"architecture": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "vocab_size": 1000}}


def _written(**sections) -> dict:
    raw = {"model": TINY_MODEL, "data": {"synthetic": {"num_samples": 100}}, "training": {"max_steps": 10}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def make_spec(**sections) -> dict:
    """The job resolved as the loader resolves it (tests/spec_builder.py)."""
    return build_spec(base=_written(**sections))


def unchecked_spec(**sections) -> dict:
    """Defaults filled, no rule run: a job the loader refuses, for compile's own guards against it."""
    return fill_defaults(_written(**sections))


def compile_(spec: dict, num_train_samples: int | None = None, **kwargs):
    return compile_spec(spec, derive(spec, num_train_samples=num_train_samples), **kwargs)


class FakeDataParallel:
    """Enough of an mpu for DeepSpeedConfig to use `world` ranks without initialising distributed."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self):
        return self.world


@pytest.fixture
def deepspeed_config(monkeypatch):
    """DeepSpeedConfig(cfg) as rank 0 of `world` ranks, with no process group."""
    pytest.importorskip("deepspeed")
    from deepspeed import comm
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeedConfig asks deepspeed.comm for the rank first and falls back to world size 1.
    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)

    def build(cfg: dict, world: int):
        return DeepSpeedConfig(cfg, mpu=FakeDataParallel(world))
    return build


def check_scheduler_constructs(ds_config: dict) -> None:
    """DeepSpeed's own scheduler class accepts the compiled params (catches misspelt names)."""
    import torch
    from deepspeed.runtime import lr_schedules
    scheduler = ds_config["scheduler"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"])


# ----------------------------------------------------------------- batch and steps

@pytest.mark.parametrize("micro, global_batch, gpus, nodes, accumulation, expected_global", [
    (8, None, 1, 1, 1, 8),
    (8, None, 2, 1, 1, 16),
    (1, 4, 1, 1, 4, 4),
    (2, 32, 2, 2, 4, 32),
])
def test_batch_fields_are_explicit(micro, global_batch, gpus, nodes, accumulation, expected_global):
    spec = make_spec(training={"max_steps": 10, "micro_batch_size": micro, "global_batch_size": global_batch},
                     resources={"gpus_per_node": gpus, "nodes": nodes})
    c = compile_(spec)
    assert c.ds_config["train_batch_size"] == expected_global
    assert c.ds_config["train_micro_batch_size_per_gpu"] == micro
    assert c.ds_config["gradient_accumulation_steps"] == accumulation
    assert c.derived.world_size == gpus * nodes
    assert c.plan.world_size == gpus * nodes


def test_global_batch_not_a_multiple_is_a_spec_error():
    spec = unchecked_spec(training={"max_steps": 10, "micro_batch_size": 3, "global_batch_size": 10})
    with pytest.raises(SpecError) as err:
        compile_(spec)
    assert err.value.issues[0].path == ("training", "global_batch_size")
    assert "9 or 12" in err.value.issues[0].hint


def test_epochs_with_too_few_samples_for_one_micro_batch_is_an_error():
    spec = unchecked_spec(data={"synthetic": {"num_samples": 5}},
                          training={"max_steps": None, "epochs": 3, "micro_batch_size": 8})
    with pytest.raises(SpecError) as err:
        compile_(spec)
    assert err.value.issues[0].path == ("training", "micro_batch_size")


@pytest.mark.parametrize("samples, expected", [
    (100, 6),   # 6 whole global batches of 16
    (110, 6),   # 55 per rank would be 13 micro-batches, ceil(13 / 2) = 7 steps: an epoch is whole global batches
])
def test_epochs_count_whole_global_batches(samples, expected):
    # 2 ranks x micro 4 x accumulation 2 = global batch 16: the loader's epoch (data/loaders.epoch_samples)
    # is the same samples for every split, floor(samples / 16) steps
    spec = make_spec(data={"synthetic": {"num_samples": samples}}, resources={"gpus_per_node": 2},
                     training={"max_steps": None, "epochs": 1, "micro_batch_size": 4, "global_batch_size": 16})
    assert compile_(spec).derived.total_steps == expected


@pytest.mark.parametrize("training", [{"max_steps": None, "epochs": 1}, {"max_steps": 3}])
def test_fewer_samples_than_one_global_batch_is_an_error(training):
    # 12 samples: 3 micro-batches of 4 on 1 rank, but not one global batch of 16 (accumulation 4)
    spec = unchecked_spec(data={"synthetic": {"num_samples": 12}},
                          training={**training, "micro_batch_size": 4, "global_batch_size": 16})
    with pytest.raises(SpecError) as err:
        compile_(spec)
    issue = err.value.issues[0]
    assert issue.path == ("training", "global_batch_size") and "12 training samples" in issue.message


@pytest.mark.parametrize("epochs, samples, global_batch, expected", [
    (1, 512, 4, 128),
    (1, 100, 8, 12),      # the loader drops the incomplete last global batch: 12 steps, not 13
    (2, 100, 8, 24),
    (0.5, 100, 8, 6),
    (1.1, 100, 8, 14),    # ceil(1.1 * 12)
])
def test_epochs_to_total_steps(epochs, samples, global_batch, expected):
    synthetic = unchecked_spec(data={"synthetic": {"num_samples": samples}},
                               training={"max_steps": None, "epochs": epochs, "micro_batch_size": global_batch})
    assert compile_(synthetic).derived.total_steps == expected
    files = unchecked_spec(data={"synthetic": None, "train": "/data/train.jsonl"},
                           training={"max_steps": None, "epochs": epochs, "micro_batch_size": global_batch})
    assert compile_(files, num_train_samples=samples).derived.total_steps == expected


def test_epochs_with_files_and_no_sample_count_is_a_spec_error():
    spec = unchecked_spec(data={"synthetic": None, "train": "/data/train.jsonl"},
                          training={"max_steps": None, "epochs": 1})
    with pytest.raises(SpecError) as err:
        compile_(spec)
    assert err.value.issues[0].path == ("training", "epochs")
    assert "max_steps" in err.value.issues[0].hint


# ----------------------------------------------------------------- optimizer and scheduler

def test_adamw_block():
    spec = make_spec(training={"max_steps": 10, "optimizer": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                               "weight_decay": 0.1}})
    c = compile_(spec)
    # `auto`: torch's fused AdamW, said in full (DeepSpeed passes every key but its own to torch)
    assert c.ds_config["optimizer"] == {"type": "AdamW", "params": {
        "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True, "fused": True,
        "adam_w_mode": True}}
    # DeepSpeed builds it: nothing in the patches but the decay groups (no optimizer entry)
    assert [p["name"] for p in c.patches] == ["attention_implementation", "parameter_groups"]
    import torch
    accepted = inspect.signature(torch.optim.AdamW).parameters
    assert set(c.ds_config["optimizer"]["params"]) - {"torch_adam", "adam_w_mode"} <= set(accepted)
    # `bias_correction: false` only DeepSpeed's FusedAdam implements: auto takes it (and its op build)
    spec["training"]["optimizer"]["bias_correction"] = False
    params = compile_(spec).ds_config["optimizer"]["params"]
    assert params["torch_adam"] is False and params["bias_correction"] is False
    from deepspeed.ops.adam import FusedAdam  # importing the class builds nothing
    assert set(params) - {"torch_adam"} <= set(inspect.signature(FusedAdam).parameters)


def _adam_class_deepspeed_builds(config):
    """The class DeepSpeed's engine builds from a compiled AdamW block, and the keywords it passes it
    (deepspeed/runtime/engine.py: _configure_basic_optimizer / get_optimizer_configuration)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    params = dict(config.optimizer_params)
    params.pop("adam_w_mode")
    if params.pop("torch_adam"):
        return torch.optim.AdamW, {**params, "foreach": None}
    return (DeepSpeedCPUAdam if config.zero_config.offload_optimizer else FusedAdam), params


@pytest.mark.parametrize("implementation, memory, torch_adam, built", [
    ("auto", {}, True, "AdamW"),
    ("auto", {"zero_stage": 2, "offload": {"optimizer": "cpu"}}, False, "DeepSpeedCPUAdam"),
    ("fused", {"zero_stage": 1}, False, "FusedAdam"),
    ("cpu", {"zero_stage": 3, "offload": {"optimizer": "cpu"}}, False, "DeepSpeedCPUAdam"),
    ("torch", {}, True, "AdamW"),
    ("torch", {"zero_stage": 2, "offload": {"optimizer": "cpu"}}, True, "AdamW"),
])
def test_adam_implementation(implementation, memory, torch_adam, built, deepspeed_config):
    spec = make_spec(training={"max_steps": 10, "optimizer": {"implementation": implementation}}, memory=memory)
    c = compile_(spec)
    params = c.ds_config["optimizer"]["params"]
    assert params["torch_adam"] is torch_adam
    # torch.optim.AdamW has no bias_correction keyword; DeepSpeed's Adams get it explicitly
    assert ("bias_correction" in params) is (not torch_adam)
    offloaded = memory.get("offload", {}).get("optimizer") == "cpu"
    assert c.ds_config.get("zero_force_ds_cpu_optimizer", True) is not (torch_adam and offloaded)
    config = deepspeed_config(c.ds_config, 1)
    cls, kwargs = _adam_class_deepspeed_builds(config)
    assert cls.__name__ == built
    assert set(kwargs) <= set(inspect.signature(cls).parameters), kwargs
    if cls.__name__ == "AdamW":   # constructs without building any op
        cls([__import__("torch").nn.Parameter(__import__("torch").zeros(2))], **kwargs)


def test_bias_correction_reaches_deepspeed(deepspeed_config):
    spec = make_spec(training={"max_steps": 10, "optimizer": {"bias_correction": False}},
                     memory={"zero_stage": 2, "offload": {"optimizer": "cpu"}})
    c = compile_(spec)
    assert c.ds_config["optimizer"]["params"]["bias_correction"] is False
    config = deepspeed_config(c.ds_config, 1)
    assert config.optimizer_params["bias_correction"] is False


def test_fp16_auto_cast(deepspeed_config):
    c = compile_(make_spec(memory={"precision": "fp16", "fp16": {"auto_cast": True}}))
    assert c.ds_config["fp16"]["auto_cast"] is True
    assert deepspeed_config(c.ds_config, 1).float16_config.auto_cast is True
    assert compile_(make_spec(memory={"precision": "fp16"})).ds_config["fp16"]["auto_cast"] is False
    assert "auto_cast" not in compile_(make_spec(memory={"precision": "bf16"})).ds_config["fp16"]


@pytest.mark.parametrize("export, gathered", [
    ({}, True), ({"final": False}, False), ({"final": False, "best_eval": True}, True),
    ({"final": False, "at_checkpoints": True}, True),
])
def test_zero3_gathers_16bit_weights_when_the_job_exports(export, gathered, deepspeed_config):
    c = compile_(unchecked_spec(memory={"zero_stage": 3}, export=export))
    assert c.ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is gathered
    assert deepspeed_config(c.ds_config, 1).zero_config.gather_16bit_weights_on_model_save is gathered
    assert "stage3_gather_16bit_weights_on_model_save" not in \
        compile_(unchecked_spec(memory={"zero_stage": 2}, export=export)).ds_config["zero_optimization"]


def test_sgd_block_builds_torch_sgd(deepspeed_config):
    import torch
    spec = make_spec(training={"max_steps": 10, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
                     memory={"zero_stage": 2})
    c = compile_(spec)
    assert c.ds_config["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}}
    assert c.ds_config["zero_allow_untested_optimizer"] is True
    config = deepspeed_config(c.ds_config, 1)
    # DeepSpeed falls back to getattr(torch.optim, name) for names it does not know
    assert config.optimizer_name == "SGD"
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], **config.optimizer_params)


@pytest.mark.parametrize("name, expected_keys", [
    ("adamw_8bit", {"name", "lr", "betas", "eps", "weight_decay"}),
    ("adafactor", {"name", "lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay",
                   "scale_parameter", "relative_step", "warmup_init"}),
])
def test_client_optimizers_are_built_by_the_ranks_from_the_spec(name, expected_keys):
    spec = make_spec(training={"max_steps": 10, "optimizer": {"name": name, "lr": 2e-4}}, memory={"zero_stage": 1})
    c = compile_(spec)
    assert "optimizer" not in c.ds_config
    # no patch: the ranks build it from the resolved spec with its module's client_args (train/patches.client_optimizer)
    assert [p["name"] for p in c.patches] == ["attention_implementation"]
    args = optimizers.get(name).client_args(spec["training"]["optimizer"])
    assert set(args) == expected_keys and args["name"] == name and args["lr"] == 2e-4
    assert c.ds_config["zero_allow_untested_optimizer"] is True


def test_adafactor_args_match_transformers_signature():
    from transformers.optimization import Adafactor
    spec = make_spec(training={"max_steps": 10, "optimizer": {"name": "adafactor"}})
    args = optimizers.get("adafactor").client_args(spec["training"]["optimizer"])
    assert set(args) - {"name"} <= set(inspect.signature(Adafactor).parameters)


@pytest.mark.parametrize("scheduler, total, expected", [
    ({"name": "constant", "warmup_steps": 5}, 100,
     {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5,
                                     "warmup_type": "linear", "last_batch_iteration": 0}}),
    # no warmup: flat from the first step (DeepSpeed needs warmup_num_steps > 0)
    ({"name": "constant"}, 100,
     {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-3, "warmup_num_steps": 1,
                                     "warmup_type": "linear", "last_batch_iteration": 0}}),
    ({"name": "linear", "warmup_ratio": 0.1}, 95,
     {"type": "WarmupDecayLR", "params": {"total_num_steps": 95, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                          "warmup_num_steps": 10, "warmup_type": "linear",
                                          "last_batch_iteration": 0}}),
    ({"name": "cosine", "warmup_steps": 7, "min_lr_ratio": 0.1}, 50,
     {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 7, "warmup_min_ratio": 0.0,
                                           "cos_min_ratio": 0.1, "warmup_type": "linear",
                                           "last_batch_iteration": 0}}),
])
def test_scheduler_mapping(scheduler, total, expected):
    spec = make_spec(training={"max_steps": total, "optimizer": {"lr": 1e-3}, "scheduler": scheduler})
    c = compile_(spec)
    assert c.ds_config["scheduler"] == expected
    assert c.derived.warmup_steps == (scheduler.get("warmup_steps")
                                         or math.ceil(scheduler.get("warmup_ratio", 0) * total))
    check_scheduler_constructs(c.ds_config)


def test_linear_min_lr_ratio_is_the_decay_floor():
    spec = make_spec(training={"max_steps": 20, "optimizer": {"lr": 1e-3},
                               "scheduler": {"name": "linear", "warmup_steps": 2, "min_lr_ratio": 0.1}})
    c = compile_(spec)
    # lr * min_lr_ratio: one float64 multiplication, half an ulp from 1e-4
    assert c.ds_config["scheduler"]["params"]["warmup_min_lr"] == pytest.approx(1e-4, rel=2**-53)
    assert any("min_lr" in note for note in c.notes)


# ----------------------------------------------------------------- precision, ZeRO, offload

def test_fp16_block_has_every_loss_scale_setting():
    spec = make_spec(memory={"precision": "fp16", "fp16": {"initial_scale_power": 12, "hysteresis": 3}})
    c = compile_(spec)
    assert c.ds_config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                   "loss_scale_window": 1000, "hysteresis": 3, "min_loss_scale": 1,
                                   "auto_cast": False}
    assert c.ds_config["bf16"] == {"enabled": False}


H = 64  # TINY_MODEL's hidden size

ZERO_TABLE = [
    ({"zero_stage": 0}, {"stage": 0}),
    ({"zero_stage": 1}, {"stage": 1, "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": H * H,
                         "reduce_scatter": True, "allgather_bucket_size": 500_000_000, "round_robin_gradients": False}),
    ({"zero_stage": 2, "offload": {"optimizer": "cpu"}},
     {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": H * H,
      "reduce_scatter": True, "allgather_bucket_size": 500_000_000, "round_robin_gradients": False,
      "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    ({"zero_stage": 2, "zero": {"overlap_comm": False, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000}},
     {"stage": 2, "overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": 1000,
      "reduce_scatter": True, "allgather_bucket_size": 2000, "round_robin_gradients": False}),
    ({"zero_stage": 3, "offload": {"optimizer": "cpu", "params": "cpu", "pin_memory": False}},
     {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": H * H,
      "stage3_prefetch_bucket_size": int(0.9 * H * H), "stage3_param_persistence_threshold": 10 * H,
      "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9, "sub_group_size": 10**9,
      "stage3_gather_16bit_weights_on_model_save": True,
      "offload_optimizer": {"device": "cpu", "pin_memory": False},
      "offload_param": {"device": "cpu", "pin_memory": False}}),
    ({"zero_stage": 3, "offload": {"optimizer": "nvme", "params": "nvme", "nvme_path": "/nvme"}},
     {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": H * H,
      "stage3_prefetch_bucket_size": int(0.9 * H * H), "stage3_param_persistence_threshold": 10 * H,
      "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9, "sub_group_size": 10**9,
      "stage3_gather_16bit_weights_on_model_save": True,
      "offload_optimizer": {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"},
      "offload_param": {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme", "buffer_count": 5,
                        "buffer_size": 100_000_000}}),
    # an explicit 0 is kept (not replaced by the h-based size): DeepSpeed gets it, and so does the planner
    ({"zero_stage": 3, "zero": {"stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}},
     {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": H * H,
      "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0,
      "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9, "sub_group_size": 10**9,
      "stage3_gather_16bit_weights_on_model_save": True}),
]


@pytest.mark.parametrize("memory, expected", ZERO_TABLE)
def test_zero_block(memory, expected, deepspeed_config):
    c = compile_(make_spec(memory=memory))
    assert c.ds_config["zero_optimization"] == expected
    uses_nvme = "nvme" in str(memory.get("offload"))
    assert ("aio" in c.ds_config) == uses_nvme
    config = deepspeed_config(c.ds_config, 1)
    assert config.zero_optimization_stage == expected["stage"]
    if expected["stage"]:
        assert config.zero_config.reduce_bucket_size == expected["reduce_bucket_size"]


def test_unknown_hidden_size_writes_deepspeeds_defaults():
    spec = make_spec(model={"architecture": "someformer", "config": {}}, memory={"zero_stage": 3})
    assert model_dims(spec) is None
    zero = compile_(spec).ds_config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (500_000_000, 50_000_000, 100_000)


# The offload rules a spec changed after validation breaks (memory.fit) are refused by validation run
# again, positioned, no longer by the compiler: tests/test_prepare_job.py.


def test_aio_block_uses_deepspeeds_names(deepspeed_config):
    spec = make_spec(memory={"zero_stage": 3, "offload": {"params": "nvme", "nvme_path": "/nvme",
                                                          "aio": {"thread_count": 4, "queue_depth": 16}}})
    c = compile_(spec)
    config = deepspeed_config(c.ds_config, 1)
    assert config.aio_config["intra_op_parallelism"] == 4
    assert config.aio_config["queue_depth"] == 16


# The whole table: stage x precision x offload x checkpointing x accumulation, on 2 ranks.
SWEEP = [
    (stage, precision, offload, checkpointing, accumulation)
    for stage, precision, offload, checkpointing, accumulation in itertools.product(
        (0, 1, 2, 3), ("fp32", "fp16", "bf16"), ("none", "optimizer", "both"),
        (False, True, {"every_n_layers": 2}), (1, 4))
    if not (offload == "optimizer" and stage == 0) and not (offload == "both" and stage != 3)
]


@pytest.mark.parametrize("stage, precision, offload, checkpointing, accumulation", SWEEP)
def test_sweep_is_explicit_and_accepted(stage, precision, offload, checkpointing, accumulation, deepspeed_config):
    offload_block = {"none": {}, "optimizer": {"optimizer": "cpu"},
                     "both": {"optimizer": "cpu", "params": "cpu"}}[offload]
    spec = make_spec(memory={"zero_stage": stage, "precision": precision, "offload": offload_block,
                             "activation_checkpointing": checkpointing},
                     training={"max_steps": 10, "micro_batch_size": 2, "global_batch_size": 4 * accumulation},
                     resources={"gpus_per_node": 2})
    c = compile_(spec)
    cfg = c.ds_config
    assert find_auto(cfg) == []
    assert cfg["gradient_accumulation_steps"] == accumulation
    assert cfg["fp16"]["enabled"] is (precision == "fp16") and cfg["bf16"]["enabled"] is (precision == "bf16")
    zero = cfg["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) is (offload != "none")
    assert ("offload_param" in zero) is (offload == "both")
    assert ("stage3_prefetch_bucket_size" in zero) is (stage == 3)
    assert "activation_checkpointing" not in cfg  # HF models are checkpointed by the patch
    ckpt = [p["args"] for p in c.patches if p["name"] == "gradient_checkpointing"]
    if checkpointing:
        every = checkpointing["every_n_layers"] if isinstance(checkpointing, dict) else 1
        assert ckpt == [{"every_n_layers": every, "use_reentrant": False}]
    else:
        assert ckpt == []
    config = deepspeed_config(cfg, 2)
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (4 * accumulation, accumulation)
    assert config.zero_optimization_stage == stage


# ----------------------------------------------------------------- patches and launch

def test_patches_in_order():
    # every patch at once: model.freeze with model.lora is a combination the loader refuses
    spec = unchecked_spec(model={**TINY_MODEL, "attention": "eager", "freeze": ["embeddings.*"], "compile": True,
                                 "lora": {}},
                          memory={"tf32": True,
                                  "activation_checkpointing": {"every_n_layers": 2, "use_reentrant": True}},
                          training={"max_steps": 10, "optimizer": {"name": "adamw_8bit", "weight_decay": 0.1}})
    names = [p["name"] for p in compile_(spec).patches]
    # PEFT's adapters on the patched base, before torch.compile; the optimizer is no patch (no-op entry gone)
    assert names == ["attention_implementation", "tf32", "freeze", "gradient_checkpointing", "parameter_groups",
                     "lora", "torch_compile"]
    plain = [p["name"] for p in compile_(make_spec()).patches]
    assert plain == ["attention_implementation"]


def test_lora_is_a_patch_with_its_resolved_settings():
    spec = make_spec(model={**TINY_MODEL, "task": "sequence-classification",
                            "lora": {"r": 4, "target_modules": ["query", "value"], "use_rslora": True}},
                     memory={"activation_checkpointing": True})
    (lora,) = [p for p in compile_(spec).patches if p["name"] == "lora"]
    # every LoraConfig field said, defaults filled; modules_to_save null: the task's head modules (the
    # ranks keep those the model has); checkpointing with a frozen base: the embeddings' output needs grad
    assert lora["args"] == {"r": 4, "alpha": 16, "dropout": 0.05, "target_modules": ["query", "value"],
                            "modules_to_save": ["pre_classifier", "classifier", "score"], "bias": "none",
                            "use_rslora": True, "use_dora": False, "enable_input_require_grads": True}
    assert patch_text(lora) == "LoRA r 4 alpha 16 on query, value rsLoRA"
    spec["model"]["lora"].update(modules_to_save=[], target_modules="all-linear")
    spec["memory"]["activation_checkpointing"] = False
    (lora,) = [p for p in compile_(spec).patches if p["name"] == "lora"]
    assert lora["args"]["modules_to_save"] == [] and lora["args"]["target_modules"] == "all-linear"
    assert lora["args"]["enable_input_require_grads"] is False
    spec["model"]["lora"] = None
    assert [p["name"] for p in compile_(spec).patches] == ["attention_implementation"]


def test_launch_argv_single_and_multi_node():
    one = compile_(make_spec(resources={"gpus_per_node": 2}), run_dir="/runs/x").plan
    assert one.command == ["deepspeed", "--num_gpus", "2", "--master_port", "29500", "--module", "jobspec.train.worker",
                           "--run-dir", "/runs/x"]
    fixed = compile_(make_spec(resources={"master_port": 31000}), master_port=None).plan
    assert fixed.master_port == 31000 and "31000" in fixed.command
    given = compile_(make_spec(resources={"master_port": 31000}), master_port=40000).plan
    assert given.master_port == 40000
    multi = compile_(make_spec(resources={"nodes": 2, "gpus_per_node": 4, "master_addr": "node1"})).plan
    assert multi.command[:5] == ["deepspeed", "--num_nodes", "2", "--master_addr", "node1"]
    assert (multi.world_size, multi.nodes, multi.gpus_per_node) == (8, 2, 4)


def test_the_launch_plan_is_frozen_and_its_record_is_launch_json_s_launch_fields():
    plan = compile_(make_spec(resources={"gpus_per_node": 2}), run_dir="/runs/x", master_port=29517).plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.master_port = 1   # type: ignore[misc]
    assert plan.environment["PYTHONUNBUFFERED"] == "1"   # the ranks' output reaches the launcher as it happens
    assert plan.record() == {"argv": plan.command, "world_size": 2, "nodes": 1, "gpus_per_node": 2,
                             "master_port": 29517}
    assert plan.record(["python", "-m", "x"])["argv"] == ["python", "-m", "x"]   # the argv that runs, when given


# ----------------------------------------------------------------- overrides and "auto"

def test_override_replaces_and_notes():
    spec = unchecked_spec(memory={"zero_stage": 2},
                          deepspeed={"zero_optimization": {"reduce_bucket_size": "5e8"}, "steps_per_print": 1,
                                     "comms_logger": {"enabled": True}})
    c = compile_(spec)
    assert c.ds_config["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert c.ds_config["zero_optimization"]["overlap_comm"] is True  # siblings survive the deep merge
    assert "deepspeed.zero_optimization.reduce_bucket_size overrides compiled 4096 -> 500000000" in c.notes
    assert "deepspeed.steps_per_print overrides compiled 1000000000 -> 1" in c.notes
    assert any(n.startswith("deepspeed.comms_logger adds") for n in c.notes)


@pytest.mark.parametrize("override", [
    {"zero_optimization": {"reduce_bucket_size": "auto"}},
    {"optimizer": {"params": {"lr": "AUTO"}}},
])
def test_auto_override_is_refused(override):
    with pytest.raises(SpecError) as err:
        compile_(unchecked_spec(memory={"zero_stage": 2}, deepspeed=override))
    assert "silently" in str(err.value) and '"auto"' in str(err.value)


def test_batch_override_is_refused():
    with pytest.raises(SpecError) as err:
        compile_(make_spec(deepspeed={"train_batch_size": 64}))
    assert "global_batch_size" in err.value.issues[0].hint


def test_find_auto_finds_nested():
    assert find_auto({"a": {"b": ["x", "auto"]}, "c": 1}) == [("a", "b", 1)]


# ----------------------------------------------------------------- model dimensions (jobspec.spec.model_dims)

def test_model_dims_precedence_and_aliases(tmp_path):
    from jobspec.spec.model_dims import read_local_config
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 8}')
    config_json = read_local_config(str(tmp_path))
    spec = {"model": {"name_or_path": str(tmp_path), "architecture": None, "config": {"n_layer": 2}}}
    dims = model_dims(spec, config_json)
    assert (dims.model_type, dims.hidden_size, dims.num_layers, dims.num_heads) == ("gpt2", 256, 2, 8)
    assert dims.vocab_size == 50257 and dims.intermediate_size == 4 * 256  # architecture defaults underneath
    assert read_local_config(str(tmp_path / "missing")) is None
    assert read_local_config("org/hub-model") is None


def test_model_dims_unknown_architecture():
    assert model_dims({"model": {"architecture": "someformer", "config": {}}}) is None
    dims = model_dims({"model": {"architecture": "someformer", "config": {"hidden_size": 96}}})
    assert dims.hidden_size == 96


TINY_CONFIGS = {
    "bert": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
             "vocab_size": 100, "max_position_embeddings": 64},
    "xlm-roberta": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
                    "vocab_size": 100, "max_position_embeddings": 66, "type_vocab_size": 1},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 64},
    "llama": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 48, "vocab_size": 100, "max_position_embeddings": 64},
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 48, "vocab_size": 100,
                   "max_position_embeddings": 64},
}
LM_TASK = {"bert": "masked-lm", "xlm-roberta": "masked-lm", "gpt2": "causal-lm", "llama": "causal-lm",
           "distilbert": "masked-lm"}
# The real sizes: transformers' defaults, and the job files' XLM-R large / GPT-2 XL.
REAL_CONFIGS = [("bert", {}), ("xlm-roberta", {}), ("gpt2", {}),
                ("xlm-roberta", {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                                 "intermediate_size": 4096, "vocab_size": 250002, "max_position_embeddings": 514,
                                 "type_vocab_size": 1}),
                ("gpt2", {"n_embd": 1600, "n_layer": 48, "n_head": 25})]


def _transformers_count(architecture: str, config: dict, task: str, num_labels: int) -> int:
    import torch
    import transformers
    auto = {"sequence-classification": transformers.AutoModelForSequenceClassification,
            "token-classification": transformers.AutoModelForTokenClassification,
            "masked-lm": transformers.AutoModelForMaskedLM, "causal-lm": transformers.AutoModelForCausalLM}[task]
    hf_config = transformers.AutoConfig.for_model(architecture, num_labels=num_labels, **config)
    with torch.device("meta"):  # shapes only: real sizes build instantly and allocate nothing
        model = auto.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("architecture", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("task", ["sequence-classification", "token-classification", "lm"])
def test_num_parameters_tiny(architecture, task):
    """The planner's inventory (jobspec.model.planner_trace) is the task model transformers builds, tied weights once."""
    from jobspec.model.planner_trace import ModelTracer
    task = LM_TASK[architecture] if task == "lm" else task
    config = TINY_CONFIGS[architecture]
    spec = fill_defaults({"model": {"architecture": architecture, "config": config, "task": task, "num_labels": 3}})
    assert ModelTracer(spec).inventory().total == _transformers_count(architecture, config, task, 3)


@pytest.mark.parametrize("architecture, config", REAL_CONFIGS)
@pytest.mark.parametrize("task", ["sequence-classification", "lm"])
def test_num_parameters_real_sizes(architecture, config, task):
    from jobspec.model.planner_trace import ModelTracer
    task = LM_TASK[architecture] if task == "lm" else task
    spec = fill_defaults({"model": {"architecture": architecture, "config": config, "task": task, "num_labels": 2}})
    assert ModelTracer(spec).inventory().total == _transformers_count(architecture, config, task, 2)


def test_a_compiled_config_deepspeed_refuses_fails_at_compile_time():
    from jobspec.compile.compiler import assert_deepspeed_accepts
    assert_deepspeed_accepts(compile_(make_spec()).ds_config)
    with pytest.raises(SpecError, match="fp16.min_loss_scale"):   # DeepSpeedFP16Config: an int
        assert_deepspeed_accepts({"fp16": {"enabled": True, "min_loss_scale": 0.5}})


def test_min_loss_scale_must_be_an_integer_as_deepspeed_reads_it():
    from jobspec.spec.schema import subschema_at
    node = subschema_at(("memory", "fp16", "min_loss_scale"))
    assert node["type"] == "integer" and node["minimum"] == 1
