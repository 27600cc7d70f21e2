"""The 2-rank splits of tests/train/test_split_equivalence.py, all in one launch (real launches are dear).

    deepspeed --num_gpus 2 --master_port P tests/train/split_ranks.py OUT_DIR

Each rank trains every case of CASES in turn on the one process group (the worker's build_engine and
Trainer, as tests/train/split_runs.py runs them), and rank 0 saves {case: (weights, train/loss)} to
OUT_DIR/ranks.pt.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import split_runs  # noqa: E402

# (task, micro-batch, ZeRO stage) on 2 ranks: 2 x 8 and 2 x 2 x 4 (global batch 16)
CASES = [(task, micro, zero) for zero in (0, 2) for task in ("chat", "mlm") for micro in (8, 2)]


def main(out_dir: Path) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from jobspec import ops
    ops.skip_unused_ops()   # as the worker: DeepSpeed's shm all-reduce op, unused in training, not built
    deepspeed.init_distributed()
    results = {}
    for task, micro, zero in CASES:
        weights, sink, _, engine = split_runs.train_case(split_runs.run_files(task, world=2, micro=micro, zero=zero))
        engine.destroy()
        results[f"{task}-2x{micro}-zero{zero}"] = (weights, sink.metric("train/loss"), sink.metric("train/lr"))
    if dist.get_rank() == 0:
        torch.save(results, out_dir / "ranks.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":   # the runner adds --local_rank=N
    main(Path(next(arg for arg in sys.argv[1:] if not arg.startswith("--local_rank"))))
