"""What `training.eval_generate` costs at an evaluation, beside the eval loss pass it follows.

A chat LoRA job (a Qwen2-architecture model built from a config: hidden 256, 4 layers, the shipped
2048-token tokenizer; the shipped chat-sample records, 32 of them for evaluation, data.max_length 256)
is built on 2 CPU ranks through DeepSpeed's runner (`deepspeed --num_gpus 2`), once per ZeRO stage
asked for; each rank times, after one warm-up of each, the eval loss pass over the 32 records
(train/evaluation.evaluate) and the generation (train/generation.EvalGenerator.run: 8 prompts,
greedy) at each
max_new_tokens, the median of --repeats. The generation is bounded by max_new_tokens: its time grows
with it (an untrained model rarely stops early). Prints a markdown table (rank 0's wall times).

    python -m bench.eval_generate                      # ZeRO-0 and ZeRO-3, max_new_tokens 16 and 64
    python -m bench.eval_generate --stages 3 --tokens 8 32 128 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT = "jobspec-bench-eval-generate:"


def job_spec(stage: int, tokens: int, root: Path) -> dict:
    from jobspec.spec.schema import fill_defaults
    records = (REPO / "jobs" / "data" / "chat-sample.jsonl").read_text().splitlines()
    (root / "eval.jsonl").write_text("\n".join(records[:32]) + "\n")
    spec = fill_defaults({
        "name": "bench-eval-generate",
        "model": {"architecture": "qwen2", "task": "causal-lm",
                  "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
                             "max_position_embeddings": 512},
                  "lora": {"r": 8, "target_modules": "all-linear"}},
        "data": {"train": str(root / "eval.jsonl"), "eval": str(root / "eval.jsonl"),
                 "tokenizer": str(REPO / "jobs" / "data" / "tokenizer"), "max_length": 256, "num_workers": 0,
                 "pin_memory": False},
        "training": {"max_steps": 1, "micro_batch_size": 4, "eval_generate": {"prompts": 8, "max_new_tokens": tokens}},
        "memory": {"precision": "fp32", "zero_stage": stage},
        "logging": {"mlflow": {"enabled": False}},
        "resources": {"gpus_per_node": 2},
        "output_dir": str(root / "out"),
    })
    spec["checkpoint"]["dir"] = str(root / "out" / "checkpoints")
    return spec


def write_run_dir(spec: dict, run_dir: Path) -> None:
    import yaml

    from jobspec.compile.compiler import compile_spec
    from jobspec.spec.derived import derive
    run_dir.mkdir(parents=True)
    compiled = compile_spec(spec, derive(spec, num_train_samples=32), run_dir=str(run_dir))
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (run_dir / "ds_config.json").write_text(json.dumps(compiled.ds_config))
    (run_dir / "patches.json").write_text(json.dumps(compiled.patches))
    launch = {**compiled.plan.record(), "derived": compiled.derived.as_dict(), "notes": [], "source": str(run_dir)}
    (run_dir / "launch.json").write_text(json.dumps(launch))


def rank_main(run_dir: Path, tokens: list[int], repeats: int) -> None:
    """On each rank: the engine as the worker builds it, then the timings (rank 0 prints them)."""
    import torch.distributed as dist

    from jobspec import ops, rundir
    from jobspec.data.loaders import make_loader
    from jobspec.train.engine import build_engine, share_cpu_threads
    from jobspec.train.evaluation import evaluate
    from jobspec.train.generation import EvalGenerator
    from jobspec.train.progress import RunState

    deepspeed = ops.import_deepspeed()
    deepspeed.init_distributed()
    share_cpu_threads()
    files = rundir.read_run_files(run_dir)
    engine, _, eval_ds, _ = build_engine(files)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")

    def timed(call) -> float:
        call()   # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            call()
            dist.barrier()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def loss_pass():
        evaluate(engine, make_loader(eval_ds, micro_batch_size=4, rank=rank, world_size=world, seed=0, epoch=0,
                                     shuffle=False, num_workers=0, pin_memory=False))
    result = {"zero_stage": files.spec["memory"]["zero_stage"], "eval_records": len(eval_ds) if eval_ds else 0,
              "eval_loss_s": timed(loss_pass), "generate": {}}
    for count in tokens:
        spec = {**files.spec, "training": {**files.spec["training"], "eval_generate": {
            **files.spec["training"]["eval_generate"], "max_new_tokens": count}}}
        zero3 = files.ds_config.get("zero_optimization", {}).get("stage", 0) == 3
        generator = EvalGenerator.for_job(
            spec, batch_size=files.launch["derived"]["micro_batch_size"], zero3=zero3,
            run_dir=run_dir, rank=rank, world_size=world, group=group, sink=None, progress=None)
        state = RunState(step=1)
        seconds = timed(lambda g=generator: g.run(engine, state))
        rows = generator.run(engine, state)
        result["generate"][count] = {"seconds": seconds, "prompts": len(generator.prompts),
                                     "tokens": sum(r["tokens"] for r in rows) if rows else None}
    if rank == 0:
        print(RESULT + json.dumps(result), flush=True)


def launch(stage: int, tokens: list[int], repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-eval-generate-"))
    try:
        run_dir = root / "run"
        write_run_dir(job_spec(stage, max(tokens), root), run_dir)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
        argv = [deepspeed, "--num_gpus", "2", "--master_port", str(port), "--module", "bench.eval_generate",
                "--rank-run-dir", str(run_dir), "--tokens", *map(str, tokens), "--repeats", str(repeats)]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ})
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)), None)
        if done.returncode or line is None:
            raise SystemExit(f"ZeRO-{stage} run failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
        return json.loads(line[len(RESULT):])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(results: list[dict]) -> str:
    lines = ["| ZeRO | eval loss pass (32 records) | max_new_tokens | generation (8 prompts) | new tokens | "
             "generation / loss pass |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for result in results:
        for count, gen in result["generate"].items():
            lines.append(f"| {result['zero_stage']} | {result['eval_loss_s']:.2f} s | {count} | {gen['seconds']:.2f} s "
                         f"| {gen['tokens']} | {gen['seconds'] / result['eval_loss_s']:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank-run-dir", type=Path, help=argparse.SUPPRESS)   # set for the ranks
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_run_dir is not None:
        rank_main(args.rank_run_dir, args.tokens, args.repeats)
        return 0
    results = [launch(stage, args.tokens, args.repeats) for stage in args.stages]
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
