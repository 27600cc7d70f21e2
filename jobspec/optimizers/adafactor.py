"""`adafactor`: transformers' Adafactor, built on the ranks (train/patches.client_optimizer).

An explicit lr from the schedule (relative steps and parameter scaling off: they would ignore `lr`)
and no first moment (`beta1: None`): that keeps the state factored, a row and a column statistic per
matrix. Its eps pair is Adafactor's own, not Adam's `eps`. Not offloadable: DeepSpeed's optimizer
offload steps with its own CPU Adam.
"""
from __future__ import annotations

import math

from jobspec.optimizers.base import NOT_OFFLOADABLE, Optimizer
from jobspec.spec.types import JobSpecTrainingOptimizer

NAME = "adafactor"
# Adafactor's settings that the spec does not expose: in `client_args` (`jobspec compile` prints
# them), passed as written
FIXED = {"eps": [1e-30, 1e-3], "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": None,
         "scale_parameter": False, "relative_step": False, "warmup_init": False}
_ORDER = ("lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter",
          "relative_step", "warmup_init")


def client_args(optimizer: JobSpecTrainingOptimizer) -> dict:
    args = {**FIXED, "lr": optimizer["lr"], "weight_decay": optimizer["weight_decay"]}
    return {"name": NAME, **{key: args[key] for key in _ORDER}}


def adafactor_kwargs(args: dict) -> dict:
    """The keywords `Adafactor(...)` gets from the patch's args: every one of them but `name` (FIXED
    fills those a hand-written args dict leaves out)."""
    kwargs = {**FIXED, **{key: value for key, value in args.items() if key != "name"}}
    kwargs["eps"] = tuple(kwargs["eps"])
    return kwargs


def build(model, groups: list[dict], args: dict):
    from transformers.optimization import Adafactor

    return Adafactor(groups, **adafactor_kwargs(args))


def state_bytes(optimizer: JobSpecTrainingOptimizer, inventory) -> int:
    # beta1=None: a row and a column statistic per matrix (its last two dimensions), a full second
    # moment for vectors, all fp32.
    return 4 * sum(factored_elements(shape) for shape in inventory.trainable_shapes())


def factored_elements(shape: tuple) -> int:
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-2]) * (shape[-2] + shape[-1])


OPTIMIZER = Optimizer(
    name=NAME,
    hf_trainer_optim="adafactor",
    state_bytes=state_bytes,
    offload=NOT_OFFLOADABLE,
    args=("lr", "weight_decay"),
    client_args=client_args,
    build=build,
)
