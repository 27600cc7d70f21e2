"""What one optimizer module declares (`Optimizer`); jobspec/optimizers/__init__.py registers them.

Pure: no torch at import. `build` imports what it needs (torch, transformers, bitsandbytes) when the
ranks call it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from jobspec.spec.types import JobSpecTrainingOptimizer

# `offload`: what runs the step when DeepSpeed's optimizer offload holds the states on the CPU
# DeepSpeed's own CPU Adam: the fast path, what `plan --fit` tries
DEEPSPEED_CPU_ADAM = "deepspeed"
# the torch optimizer steps on the CPU (zero_force_ds_cpu_optimizer off): slow
TORCH_ON_CPU = "torch"
# a client optimizer: DeepSpeed's offload cannot wrap it (validation refuses)
NOT_OFFLOADABLE = None


def no_issues(r) -> list:
    return []


def steps_on_cpu(optimizer: JobSpecTrainingOptimizer) -> str | None:
    """What runs the step on the CPU without DeepSpeed's CPU Adam when the optimizer is offloaded
    (for the compiler's note), None when DeepSpeed's CPU Adam runs it: any optimizer but adamw's."""
    return f"optimizer {optimizer['name']}"


@dataclass(frozen=True)
class Optimizer:
    """One value of the schema's `training.optimizer.name`.

    Built either by DeepSpeed from the ds_config `optimizer` block (`deepspeed_block`) or by the
    ranks, as a client optimizer passed to `deepspeed.initialize` (`client_args` writes its args
    from the resolved spec, `build` turns exactly those args into the optimizer). Exactly one of the
    two ways is set.
    """

    name: str
    # bytes of optimizer state of all trainable parameters, unpartitioned, for the planner:
    # (the spec's `training.optimizer`, the model's Inventory: `.trainable`, `.trainable_shapes()`)
    state_bytes: Callable[[JobSpecTrainingOptimizer, Any], int]
    offload: str | None
    # the spec fields (`training.optimizer.<field>`) this optimizer reads; the others are ignored
    args: tuple[str, ...]
    # (the spec's `training.optimizer`, memory.offload.optimizer) -> ds_config["optimizer"]
    deepspeed_block: Callable[[JobSpecTrainingOptimizer, str], dict] | None = None
    # the spec's `training.optimizer` -> the args `build` gets (on the ranks; `jobspec compile`
    # prints them)
    client_args: Callable[[JobSpecTrainingOptimizer], dict] | None = None
    # (model, parameter groups, the patch's args) -> the torch optimizer; on the ranks
    build: Callable[[Any, list, dict], Any] | None = None
    # cross-field rules while this optimizer is chosen: r (a ResolvedSpec) -> [SpecIssue]
    issues: Callable[[Any], list] = no_issues
    # cross-field rules while ANOTHER optimizer is chosen: fields of this one that were set
    foreign_issues: Callable[[Any], list] = no_issues
    # whether DeepSpeed tested it under ZeRO (else the config says zero_allow_untested_optimizer)
    zero_tested: bool = False
    # the spec's `training.optimizer` -> what steps on the CPU without DeepSpeed's CPU Adam when the
    # optimizer is offloaded (the config then says zero_force_ds_cpu_optimizer: false), None: its
    # CPU Adam
    offload_step: Callable[[JobSpecTrainingOptimizer], str | None] = steps_on_cpu
    # what `plan --fit` may try instead of it (cheaper states)
    fit_alternatives: tuple[str, ...] = ()
    # how `plan --fit` names it when it proposes it (default: its name)
    label: str = ""
    # the Hugging Face Trainer's `optim` for the same optimizer (bench/trainer_baseline.py compares)
    hf_trainer_optim: str = ""
    # fraction added to the fit search's estimated step time (ties go to the cheaper optimizer)
    step_overhead: float = 0.0

    @property
    def built_by_deepspeed(self) -> bool:
        return self.deepspeed_block is not None

    def __post_init__(self):
        if (self.deepspeed_block is None) == (self.client_args is None):
            raise TypeError(f"optimizer {self.name}: set exactly one of deepspeed_block and "
                            "client_args")
        if self.client_args is not None and self.build is None:
            raise TypeError(f"optimizer {self.name}: a client optimizer needs `build`")
        if self.offload is not None and self.client_args is not None:
            raise TypeError(f"optimizer {self.name}: DeepSpeed's optimizer offload cannot hold a "
                            "client optimizer")
