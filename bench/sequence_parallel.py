"""Ulysses sequence parallelism (`memory.sequence_parallel`): what the planner predicts a rank saves, and
the losses of N = 2 on 2 CPU ranks against 1 rank without it.

    python -m bench.sequence_parallel                 # the plans only (a minute: the traces are cached)
    python -m bench.sequence_parallel --launch        # and the two real launches (minutes on 2 cores)
    python -m bench.sequence_parallel --job jobs/llama-8b-long-context.yaml --seq-len 32768

The plan table: per rank, the traced layer activations, the embeddings' and the head's (logits and
loss), Ulysses' all-to-all buffers and the peak allocated, for N = 1, 2, 4, 8 of the job at its written
settings (the world is N ranks, so N = 1 is the plain job on one rank). The launches: a tiny Llama on
the sample chat records with the loss on the answers (the job of tests/train/test_sequence_parallel_launch.py),
`jobspec launch` with N = 2 on 2 CPU ranks and with N = 1 on 1 rank, their train/loss per step and
eval/loss side by side with the relative difference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "jobs" / "data"
GiB = 1024 ** 3

LAUNCH_JOB = {
    "name": "sp-bench",
    "model": {"architecture": "llama", "task": "causal-lm",
              "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
                         "max_position_embeddings": 128}},
    "data": {"train": str(DATA / "chat-sample.jsonl"), "eval": str(DATA / "chat-sample.jsonl"),
             "tokenizer": str(DATA / "tokenizer"), "records": "chat", "loss_on": "answers", "max_length": 96,
             "padding": "longest", "num_workers": 0, "pin_memory": False},
    "training": {"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 8, "seed": 5, "eval_every": 2,
                 "gradient_clipping": 0.0, "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0},
                 "scheduler": {"name": "constant", "warmup_steps": 0}},
    "memory": {"precision": "fp32"},
    "checkpoint": {"save_final": False},
    "export": {"final": False},
    "logging": {"every_n_steps": 1, "mlflow": {"enabled": False}, "progress": "none"},
}


def plans(job: Path, seq_len: int | None, sizes: list[int]) -> None:
    from jobspec.memory.planner import plan_memory
    from jobspec.model.planner_trace import job_profiler
    from jobspec.spec.inputs import derive_job
    from jobspec.spec.validation import load_and_validate

    profiler = job_profiler()
    print(f"{job.name}: per-rank plan by memory.sequence_parallel (world = N ranks)")
    columns = ("layers", "embeddings", "head+loss", "all-to-all", "peak alloc")
    print(f"{'N':>3} {'seq':>8} " + " ".join(f"{c:>11}" for c in columns))
    for n in sizes:
        overrides = [f"memory.sequence_parallel={n}", f"resources.gpus_per_node={n}", "resources.nodes=1",
                     "training.global_batch_size=null"]
        if seq_len:
            overrides.append(f"data.synthetic.seq_len={seq_len}")
        resolved = load_and_validate(job, overrides=overrides)
        derived = derive_job(resolved.spec, profiler=profiler)
        plan = plan_memory(resolved.spec, derived)
        b = plan.breakdown
        values = (b["activations"], b["embeddings_activations"], b["logits_and_loss"], b["all_to_all_buffers"],
                  plan.peak_allocated)
        print(f"{n:>3} {derived.seq_len:>8} " + " ".join(f"{v / GiB:>10.2f}G" for v in values))


def launch(root: Path, n: int) -> list[dict]:
    spec = json.loads(json.dumps(LAUNCH_JOB))
    spec["memory"]["sequence_parallel"] = n
    spec["resources"] = {"gpus_per_node": n}
    spec["output_dir"] = str(root / f"sp{n}")
    job = root / f"sp{n}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([sys.executable, "-m", "jobspec", "launch", str(job)], cwd=root, capture_output=True,
                            text=True, env={**os.environ, "JOBSPEC_PROGRESS": "none"})
    if result.returncode != 0:
        raise SystemExit(f"launch with N = {n} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    run_dir = max((root / f"sp{n}").glob("run-*"))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare_launches() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = {n: launch(Path(tmp), n) for n in (2, 1)}

    def series(name: str, n: int) -> list[tuple[int, float]]:
        return [(r["step"], r["metrics"][name]) for r in rows[n] if name in r.get("metrics", {})]
    print("\nlosses: memory.sequence_parallel 2 on 2 CPU ranks vs 1 rank without it (fp32)")
    print(f"{'metric':>10} {'step':>4} {'N = 2':>20} {'1 rank':>20} {'relative':>10}")
    for name in ("train/loss", "eval/loss"):
        for (step, got), (_, want) in zip(series(name, 2), series(name, 1)):
            print(f"{name:>10} {step:>4} {got:>20.15f} {want:>20.15f} {abs(got - want) / abs(want):>10.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=REPO / "jobs" / "llama-8b-long-context.yaml")
    parser.add_argument("--seq-len", type=int, default=None, help="the job's synthetic seq_len instead of its own")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--launch", action="store_true", help="also launch N = 2 on 2 CPU ranks and 1 rank")
    args = parser.parse_args()
    plans(args.job, args.seq_len, [int(n) for n in args.sizes.split(",")])
    if args.launch:
        compare_launches()


if __name__ == "__main__":
    main()
