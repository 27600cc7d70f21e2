"""`sgd`: built by DeepSpeed, which falls back to `torch.optim.SGD` for a name it does not know.

4 bytes of fp32 state per trainable parameter with momentum (its buffer), none without. With
optimizer offload torch's SGD steps on the CPU (no DeepSpeed CPU kernel): allowed, slow.
"""
from __future__ import annotations

from jobspec.optimizers.base import TORCH_ON_CPU, Optimizer
from jobspec.spec.types import JobSpecTrainingOptimizer

NAME = "sgd"


def deepspeed_block(optimizer: JobSpecTrainingOptimizer, offload_optimizer: str = "none") -> dict:
    # Not a DeepSpeed optimizer: DeepSpeed builds torch.optim.SGD from this name.
    return {"type": "SGD", "params": {"lr": optimizer["lr"], "momentum": optimizer["momentum"],
                                      "weight_decay": optimizer["weight_decay"]}}


def state_bytes(optimizer: JobSpecTrainingOptimizer, inventory) -> int:
    return 4 * inventory.trainable if optimizer["momentum"] > 0 else 0


def foreign_issues(r) -> list:
    """`momentum` set while another optimizer is chosen."""
    optimizer = r.spec["training"]["optimizer"]
    if optimizer["momentum"] > 0:
        return [r.issue(("training", "optimizer", "momentum"),
                        f"momentum is for sgd, not `{optimizer['name']}`",
                        "remove `momentum` (Adam uses `betas`) or set `name: sgd`",
                        code="momentum-sgd-only")]
    return []


OPTIMIZER = Optimizer(
    name=NAME,
    hf_trainer_optim="sgd",
    state_bytes=state_bytes,
    offload=TORCH_ON_CPU,
    args=("lr", "momentum", "weight_decay"),
    deepspeed_block=deepspeed_block,
    foreign_issues=foreign_issues,
)
