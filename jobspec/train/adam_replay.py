"""Make a resumed run's Adam steps bit-identical to an uninterrupted run's on DeepSpeed's CPU Adam.

DeepSpeed's C++ CPU Adam (the CPU accelerator's FusedAdam, and DeepSpeedCPUAdam for optimizer
offload on any accelerator) keeps beta1^t and beta2^t for the bias correction as float running
products: each step multiplies them by beta once (`Adam_Optimizer::IncrementStep`, cpu_adam.h).
A fresh process resuming at step t+1 has no product yet and takes `std::pow(beta, t+1)` instead,
which differs from the product in the last bit for most t (for beta2 = 0.999 from t = 3 on), so
without a replay every update after a resume is a few ULPs off and the losses drift (up to 2.2e-5
relative after a resume at step 222). The checkpoint restores every tensor exactly; only this
hidden C++ state is not in it.

`replay(optimizer)` rebuilds it: after a checkpoint is loaded it makes the same C++ object take
steps 1..t on a 1-element scratch tensor, so the products are formed exactly as the uninterrupted
run formed them; step t+1 then continues them. Cost: t calls on one element (~1 µs each).
CUDA's FusedAdam computes `pow(beta, step)` at every step and needs nothing.
"""
from __future__ import annotations

CHUNK = 2048 * 32  # DeepSpeed's multi_tensor_applier chunk size


def cpu_adam_of(optimizer):
    """The DeepSpeed CPU Adam inside `optimizer` (ZeRO, bf16 and fp16 wrappers hold it as
    `.optimizer`), as ("fused" | "cpu", optimizer), or None for any other optimizer."""
    from deepspeed.accelerator import get_accelerator
    for _ in range(4):
        name = type(optimizer).__name__
        if name == "DeepSpeedCPUAdam":
            return "cpu", optimizer
        if name == "FusedAdam":
            return ("fused", optimizer) if get_accelerator().device_name() == "cpu" else None
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def steps_taken(optimizer) -> int:
    """The step count the optimizer's state holds (its next step is this + 1)."""
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    return max(steps, default=0)


def replay(optimizer) -> int:
    """Rebuild DeepSpeed's CPU Adam running beta products after a checkpoint load; the steps
    replayed."""
    import torch

    found = cpu_adam_of(optimizer)
    if found is None:
        return 0
    kind, adam = found
    steps = steps_taken(adam)
    group = adam.param_groups[0]
    beta1, beta2 = group["betas"]
    bias_correction = 1 if group.get("bias_correction", True) else 0
    param, grad, exp_avg, exp_avg_sq = (torch.zeros(1) for _ in range(4))
    for step in range(1, steps + 1):
        # lr and weight decay 0: the scratch values do not matter, only the step sequence does
        if kind == "fused":
            adam.multi_tensor_adam(CHUNK, adam._dummy_overflow_buf,
                                   [[grad], [param], [exp_avg], [exp_avg_sq]],
                                   0.0, beta1, beta2, group["eps"], step, adam.adam_w_mode,
                                   bias_correction, 0.0)
        else:
            adam.ds_opt_adam.adam_update(adam.opt_id, step, 0.0, beta1, beta2, group["eps"], 0.0,
                                         bool(bias_correction), param, grad, exp_avg, exp_avg_sq)
    return steps
