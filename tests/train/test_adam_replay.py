"""DeepSpeed's CPU Adam keeps beta^t as running products that a checkpoint cannot hold: a resumed
optimizer steps bit-identically to an uninterrupted one only after jobspec.train.adam_replay
rebuilds them (issue 13: resumed losses off by up to 2.2e-5 relative). In-process, no ranks;
`slow` because it needs DeepSpeed's JIT-built CPU Adam ops (built before the slow tests run)."""
from __future__ import annotations

import copy

import pytest
import torch

from jobspec.train import adam_replay

pytestmark = pytest.mark.slow
STEPS, RESUME_AT = 7, 2   # beta2 = 0.999: pow(beta2, 3) is not the product of three multiplications


def make(kind: str, params):
    if kind == "fused":
        from deepspeed.ops.adam import FusedAdam
        return FusedAdam(params, lr=1e-2, adam_w_mode=True, weight_decay=0.01)
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam(params, lr=1e-2, adamw_mode=True, weight_decay=0.01)


def train(kind: str, start: torch.Tensor, grads, state: dict | None = None, replay: bool = False):
    weight = torch.nn.Parameter(start.clone())
    optimizer = make(kind, [weight])
    if state is not None:
        optimizer.load_state_dict(copy.deepcopy(state))
        if kind == "fused":
            # the CPU FusedAdam's C++ object is one per process: give it a history unlike a fresh
            # process's so that, as in one, nothing carries over from the runs above
            adam_replay.cpu_adam_of(optimizer)[1].multi_tensor_adam(
                adam_replay.CHUNK, optimizer._dummy_overflow_buf, [[torch.zeros(1)] for _ in range(4)],
                0.0, 0.9, 0.999, 1e-8, 10_000, 1, 1, 0.0)
        if replay:
            assert adam_replay.replay(optimizer) == RESUME_AT
    for grad in grads:
        weight.grad = grad.clone()
        optimizer.step()
    return weight.detach().clone(), optimizer


@pytest.mark.jit_ops("FusedAdamBuilder", "CPUAdamBuilder")   # loaded in this process
@pytest.mark.parametrize("kind", ["fused", "cpu"])  # the CPU accelerator's FusedAdam; optimizer offload's
def test_a_resumed_cpu_adam_steps_exactly_like_an_uninterrupted_one_after_the_replay(kind):
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=generator)
    grads = [torch.randn(4096, generator=generator) for _ in range(STEPS)]
    straight, _ = train(kind, start, grads)
    at_checkpoint, optimizer = train(kind, start, grads[:RESUME_AT])
    state = optimizer.state_dict()
    resumed, _ = train(kind, at_checkpoint, grads[RESUME_AT:], state, replay=True)
    assert torch.equal(resumed, straight)
    without, _ = train(kind, at_checkpoint, grads[RESUME_AT:], state, replay=False)
    assert not torch.equal(without, straight)  # what the replay repairs
    # the drift is a few ULPs (what issue 13 measured), bounded: each of the resumed steps rounds the
    # weight differently at most once (an ulp of the largest weight) and moves the update by its bias
    # correction's error (the running product against pow: under STEPS roundings, STEPS * 2**-24
    # relative) of an update of at most lr * (1 - beta1) / sqrt(1 - beta2) = 3.16 lr (Kingma & Ba's bound)
    ulp = torch.finfo(torch.float32).eps * straight.abs().max()
    bound = (STEPS - RESUME_AT) * (ulp + 1e-2 * 3.17 * STEPS * 2**-24)
    assert (without - straight).abs().max() <= bound


def test_other_optimizers_need_no_replay():
    weight = torch.nn.Parameter(torch.zeros(3))
    assert adam_replay.replay(torch.optim.AdamW([weight])) == 0  # computes beta ** step each step
