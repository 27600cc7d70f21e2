"""`adamw_8bit`: bitsandbytes' 8-bit AdamW, built on the ranks (train/patches.client_optimizer).

2 bytes of state per trainable parameter (two 8-bit moments); embeddings keep 32-bit state, as the
Hugging Face Trainer does. Not offloadable: DeepSpeed's optimizer offload steps with its own CPU
Adam.
"""
from __future__ import annotations

from jobspec.errors import spec_error
from jobspec.optimizers.base import NOT_OFFLOADABLE, Optimizer
from jobspec.spec.types import JobSpecTrainingOptimizer

NAME = "adamw_8bit"
EIGHT_BIT_OVERHEAD = 0.01       # (de)quantising optimizer states: prefer plain AdamW on ties


def client_args(optimizer: JobSpecTrainingOptimizer) -> dict:
    return {"name": NAME, "lr": optimizer["lr"], "betas": list(optimizer["betas"]),
            "eps": optimizer["eps"], "weight_decay": optimizer["weight_decay"]}


def build(model, groups: list[dict], args: dict):
    """bitsandbytes.optim.AdamW8bit over `groups` (which carry the weight decay) with the patch's
    args."""
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise spec_error(f"adamw_8bit needs bitsandbytes, which does not import here: {err}",
                         path=("training", "optimizer", "name"),
                         hint="pip install 'jobspec[bnb]' (bitsandbytes), or use adamw") from None
    import torch.nn as nn

    # exactly the args `jobspec compile` prints (client_args writes every one): no default of our
    # own
    optimizer = bnb.optim.AdamW8bit(groups, lr=float(args["lr"]), betas=tuple(args["betas"]),
                                    eps=float(args["eps"]),
                                    weight_decay=float(args["weight_decay"]))
    # Embedding rows are updated sparsely and 8-bit state quantises them badly: keep their
    # state in 32 bits, as the Hugging Face Trainer does.
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def state_bytes(optimizer: JobSpecTrainingOptimizer, inventory) -> int:
    return 2 * inventory.trainable


OPTIMIZER = Optimizer(
    name=NAME,
    hf_trainer_optim="adamw_bnb_8bit",
    state_bytes=state_bytes,
    offload=NOT_OFFLOADABLE,
    args=("lr", "betas", "eps", "weight_decay"),
    client_args=client_args,
    build=build,
    label="8-bit AdamW",
    step_overhead=EIGHT_BIT_OVERHEAD,
)
