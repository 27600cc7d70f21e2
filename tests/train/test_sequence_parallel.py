"""Ulysses sequence parallelism (`memory.sequence_parallel`, jobspec/train/sequence_parallel.py).

In-process: the shard of a batch each rank keeps; on two spawned gloo ranks (all-to-all): each family of
ULYSSES_FAMILIES gives, with N = 2, the loss and the summed gradients of one rank without it.
The real launch (2 ranks, N = 2, against 1 rank) is tests/train/test_sequence_parallel_launch.py.

Tolerance, fp32 (eps = 2^-23 = 1.2e-7): both sides compute the same per-token values; what differs is
the order of summation -- the attention's matmuls run over other shapes (a rank's heads for the whole
sequence instead of every head), the loss is two shard sums added instead of one sum, the gradients
two ranks' sums added. Each such sum of k terms of one sign is exact to k * eps relative (at worst,
the usual bound); the largest here is the hidden size's dot products (k = 32) and the sequence's
token sum (k = 24): (32 + 24) * eps = 6.7e-6. The bound used, 2e-5, allows three such roundings in
a row (layers feeding layers), far below any real error (a wrong shard, a mis-scaled loss:
differences of 1e-2 or more).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import free_port

from jobspec.techniques.sequence_parallel import ULYSSES_FAMILIES

FP32_TOLERANCE = 2e-5


class _Shards:
    """A SequenceParallel as `shard` uses it, without process groups."""

    def __init__(self, size: int, rank: int):
        from jobspec.train.sequence_parallel import SequenceParallel
        self.sp = SequenceParallel(size=size, rank=rank, group=None, data_rank=0, data_world=1, mpu=None)


def test_the_shards_put_together_are_the_padded_sequence_with_the_next_token_labels():
    ids = torch.arange(1, 15).reshape(2, 7)            # 7 tokens: padded to 9 for N = 3
    labels = ids.clone()
    labels[0, :2] = -100                                # answer-only labels
    pieces = [_Shards(3, rank).sp.shard({"input_ids": ids, "labels": labels,
                                         "attention_mask": torch.ones_like(ids)}) for rank in range(3)]
    inputs = {k: torch.cat([p[0][k] for p in pieces], dim=1) for k in ("input_ids", "position_ids")}
    next_labels = torch.cat([p[1] for p in pieces], dim=1)
    assert set(pieces[0][0]) == {"input_ids", "position_ids"}      # no mask: Ulysses attends causally
    assert inputs["input_ids"].shape == (2, 9) and torch.equal(inputs["input_ids"][:, :7], ids)
    assert torch.equal(inputs["position_ids"], torch.arange(9).expand(2, 9))
    # the label of token t is token t + 1's; the last real token and the padding predict nothing
    assert torch.equal(next_labels[:, :6], labels[:, 1:])
    assert (next_labels[:, 6:] == -100).all()
    assert all(p[1].shape == (2, 3) for p in pieces)


def test_packed_position_ids_are_kept_and_continued_over_the_padding():
    ids = torch.arange(1, 6).reshape(1, 5)
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    pieces = [_Shards(2, rank).sp.shard({"input_ids": ids, "labels": ids, "position_ids": positions})
              for rank in range(2)]
    assert torch.equal(torch.cat([p[0]["position_ids"] for p in pieces], dim=1), torch.tensor([[0, 1, 0, 1, 2, 3]]))


def _tiny_config(family: str):
    from transformers import AutoConfig
    return AutoConfig.for_model(family, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96,
                                max_position_embeddings=64, attn_implementation="sdpa")


def _family_worker(rank: int, world: int, port: int, out: str, families: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from jobspec import ops
    from jobspec.train import sequence_parallel
    ops.skip_unused_ops()   # as the worker: DeepSpeed's shm all-reduce op, unused in training, not built
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for case in families:
        family, _, tiled = case.partition("+")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_config(family), attn_implementation="sdpa").float()
        if tiled:   # memory.tiled_loss: the head and loss over 3 tiles of each shard (model/tiling.py)
            from jobspec.model.tiling import tiled_loss
            tiled_loss(model, tiles=3)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 96, (2, 23), generator=generator)     # 23 tokens: padded to 24 for N = 2
        labels = ids.clone()
        labels[0, :9] = -100                                         # rows with different labelled counts
        labels[1, 15:] = -100
        full = model(input_ids=ids, labels=labels)
        with torch.no_grad():
            full_logits = full.logits if not tiled else model.lm_head(model.model(input_ids=ids).last_hidden_state)
        full.loss.backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        sp = sequence_parallel.setup(model, {"memory": {"sequence_parallel": world, "tiled_loss": bool(tiled)}},
                                     micro_batch_size=2)
        try:
            inputs, next_labels = sp.shard({"input_ids": ids, "labels": labels})
            outputs = model(**inputs)
            # the training loss's arithmetic (train/token_loss): the shard's summed cross-entropy over the
            # labelled tokens counted on every rank
            if tiled:
                with torch.no_grad():
                    logits = model.lm_head(model.model(**inputs).last_hidden_state)
                summed = outputs.loss_sum
            else:
                logits = outputs.logits
                summed = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                           next_labels.reshape(-1), ignore_index=-100,
                                                           reduction="sum")
            totals = torch.stack([summed.detach(), (next_labels != -100).sum().float()])
            dist.all_reduce(totals)
            (summed / totals[1]).backward()
        finally:
            sequence_parallel.restore()
        chunk = logits.shape[1]
        want_logits = torch.nn.functional.pad(full_logits.detach(), (0, 0, 0, 1))[:, rank * chunk:(rank + 1) * chunk]
        logits_error = (logits.detach() - want_logits)[:, :ids.shape[1] - rank * chunk].abs().max()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(grads)     # DeepSpeed sums the group's gradients (and divides by world / N = 1)
        want = torch.cat([expected[n].reshape(-1) for n, _ in model.named_parameters()])
        results[case] = {"loss": float(totals[0] / totals[1]), "reference": float(full.loss),
                           "logits_error": float(logits_error / full_logits.abs().max()),
                           "grad_error": float((grads - want).abs().max() / want.abs().max())}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    from jobspec.shm import remove_shared_memory_buffers  # DeepSpeed's CPU all-reduce buffer of this rank
    remove_shared_memory_buffers(str(port), local_rank=rank)


@pytest.mark.slow   # two spawned gloo ranks (~20 s of imports on a small machine)
def test_each_family_with_two_shards_has_the_loss_and_gradients_of_one_rank(tmp_path):
    """For every family validation lets through, and llama with `memory.tiled_loss`: each rank's logits
    are the model's on its half of the whole sequence, the shards' summed loss over the sequence's
    labelled tokens is the model's own loss, and the two ranks' gradients summed (DeepSpeed's reduction)
    are its gradients."""
    import torch.multiprocessing as mp
    out = tmp_path / "families.json"
    families = [*sorted(ULYSSES_FAMILIES), "llama+tiled_loss"]
    mp.spawn(_family_worker, args=(2, free_port(), str(out), families), nprocs=2, join=True)
    results = json.loads(out.read_text())
    for family in families:
        got = results[family]
        assert abs(got["loss"] - got["reference"]) <= FP32_TOLERANCE * abs(got["reference"]), (family, got)
        assert got["logits_error"] <= FP32_TOLERANCE, (family, got)
        assert got["grad_error"] <= FP32_TOLERANCE, (family, got)


@pytest.mark.parametrize("saved, now, batches, expected", [
    ((2, 2), (1, 1), 6, 6),     # 2 shards of 1 data-parallel rank -> 1 rank: the same samples per rank
    ((4, 2), (4, 1), 6, 3),     # 2 data-parallel ranks -> 4: each skips half as many micro-batches
    ((2, 1), (4, 4), 6, 12),    # 2 data-parallel ranks -> 4 shards of 1: twice as many
])
def test_a_resume_counts_the_data_position_in_data_parallel_ranks(saved, now, batches, expected):
    """checkpoint/reshard's data position: samples consumed = batches x micro x (world / N), saved and resumed."""
    from jobspec.train.progress import RunState
    from jobspec.checkpoint.reshard import Reshard
    reshard = Reshard("direct", "/nowhere", "step3", saved[0], now[0], 2, saved_sequence_parallel=saved[1],
                      sequence_parallel=now[1])
    state = RunState(step=3, batches_in_epoch=batches)
    reshard.adjust(state, micro_batch_size=2, seed=1, rank=0)
    assert state.batches_in_epoch == expected
    assert "sequence_parallel" in reshard.message(3)
