"""Peak FLOP/s table, memory readings and the cross-rank max."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from jobspec.train.metrics import (any_rank, count_tokens, device_row, gather_rows, memory_snapshot, peak_flops,
                                   reduce_max, reset_peaks)
from jobspec.train.stopping import StopFlag, StopVote


@pytest.mark.parametrize("name, row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA GH200 480GB", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"),
    ("Tesla V100-SXM2-16GB", "V100 SXM"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 3090", "RTX 3090"),
    ("NVIDIA RTX A6000", "RTX A6000"),
])
def test_device_names_map_to_table_rows(name, row):
    assert device_row(name) == row


def test_peak_flops_values_and_unknowns():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert peak_flops("NVIDIA H100 PCIe", "fp16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12
    assert peak_flops("Tesla T4", "bf16") is None        # no bf16 on Turing
    assert peak_flops("cpu", "fp32") is None
    assert peak_flops("", "bf16") is None


def test_memory_snapshot_on_cpu_has_rss_and_no_gpu_keys():
    reset_peaks("cpu")
    snapshot = memory_snapshot(torch.device("cpu"))
    assert snapshot["host_rss_mib"] > 0
    assert set(snapshot) == {"host_rss_mib"}


def test_count_tokens_counts_the_attention_mask():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])}
    assert count_tokens(batch) == 4
    assert count_tokens({"input_ids": torch.zeros(3, 5)}) == 15


def test_reduce_max_without_distributed_returns_a_copy():
    values = {"b": 2.0, "a": 1.0}
    result = reduce_max(values)
    assert result == values and result is not values


def _reduce_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        # insertion order differs per rank on purpose: keys are sorted before the reduction
        values = {"x": float(rank), "y": 10.0 - rank} if rank == 0 else {"y": 10.0 - rank, "x": float(rank)}
        result = reduce_max(values)
        rows = gather_rows(torch.tensor([float(rank), 10.0 - rank], dtype=torch.float64))
        # the pipelined stop vote: only rank 1 is signalled, after step 3; both stop after step 4
        flag = StopFlag()
        vote = StopVote(flag, dist.new_group(backend="gloo"), world_size, environ={})
        stopped_at = None
        for step in range(1, 8):
            flag.requested = rank == 1 and step >= 3
            if vote(step):
                stopped_at = step
                break
        vote.close()
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as fh:
            fh.write(repr((sorted(result.items()), rows, stopped_at)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two gloo ranks (~20 s of imports on a small machine)
def test_reduce_max_gather_rows_and_the_stop_vote_over_two_ranks(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_reduce_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == repr(
            ([("x", 1.0), ("y", 10.0)], [[0.0, 10.0], [1.0, 9.0]], 4))


def _any_rank_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        votes = (any_rank(rank == 1), any_rank(False, dist.new_group(backend="gloo")))
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as fh:
            fh.write(repr(votes))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two gloo ranks
def test_a_flag_raised_on_one_rank_is_raised_on_every_rank(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_any_rank_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)] == ["(True, False)"] * 2
