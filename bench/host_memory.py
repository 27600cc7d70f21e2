"""The planner's host RAM per rank (jobspec/memory/host_ram.py) against a process's measured RSS.

    python bench/host_memory.py [--hidden 1024 --layers 8 --vocab 32000]

Three measurements, each in a fresh process (so one's peak is not another's):
- runtime: RSS after importing what a rank imports (jobspec.train.worker and engine, torch,
  transformers, DeepSpeed), and with a GPU after its CUDA context's first kernel, against RUNTIME_BYTES;
- construction: peak RSS (ru_maxrss) growth while `jobspec.model.build.build_model` builds a
  Llama-shaped model from its config for the job's compiled DeepSpeed config (ZeRO-0: a full copy, as
  the ranks build it), in fp32 and bf16 jobs, against the planner's ZeRO-0..2 construction term
  (lp x parameters); and the same model from transformers' `from_config(dtype=...)`, for reference;
- a DataLoader worker: unique set size (USS) of each forked worker after 50 batches of 8 x 512
  synthetic tokens, against DATALOADER_WORKER_BYTES.
Prints one line per measurement: measured, planned, ratio.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUNTIME = """
import json, psutil
import jobspec.train.worker, jobspec.train.engine, torch, transformers, deepspeed
out = {"rss": psutil.Process().memory_info().rss}
if torch.cuda.is_available():   # a GPU rank: its CUDA context's host side, after a first kernel
    x = torch.ones(1024, 1024, device="cuda")
    (x @ x).sum().item()
    out["rss_cuda"] = psutil.Process().memory_info().rss
    out["device"] = torch.cuda.get_device_name()
print(json.dumps(out))
"""

BUILD = """
import json, resource, sys, psutil
import jobspec.train.worker, jobspec.train.engine, torch, transformers
from jobspec.spec.schema import fill_defaults
spec = fill_defaults(json.loads(sys.argv[1]))
how = sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rss_before = psutil.Process().memory_info().rss
if how == "jobspec":   # as the ranks build it: for the compiled DeepSpeed config (model/construct)
    from jobspec.model.build import build_model
    model = build_model(spec, None, json.loads(sys.argv[3]))
else:
    from jobspec.model.build import build_config
    auto_class, config = build_config(spec)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["memory"]["precision"]]
    model = auto_class.from_config(config, dtype=dtype)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
dtypes = sorted({str(p.dtype) for p in model.parameters()})
print(json.dumps({"growth": peak - max(before, rss_before), "params": sum(p.numel() for p in model.parameters()),
                  "dtypes": dtypes}))
"""

WORKERS = """
import json, psutil
import jobspec.train.worker
from jobspec.spec.schema import fill_defaults
from jobspec.data.loaders import make_loader, synthetic_dataset
spec = fill_defaults({"model": {"architecture": "llama"}, "data": {"synthetic": {"num_samples": 4096, "seq_len": 512}}})
loader = make_loader(synthetic_dataset(spec, 4096, 0), micro_batch_size=8, rank=0, world_size=1, seed=0, epoch=0,
                     shuffle=True, num_workers=2, pin_memory=True)
batches = iter(loader)
for _ in range(50):
    next(batches)
print(json.dumps({"uss": [k.memory_full_info().uss for k in psutil.Process().children()]}))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from jobspec.compile.compiler import compile_spec
    from jobspec.memory.host_ram import DATALOADER_WORKER_BYTES, RUNTIME_BYTES, construction_bytes
    from jobspec.model.planner_trace import job_profiler
    from jobspec.spec.derived import derive
    from jobspec.spec.schema import fill_defaults
    from jobspec.units import MiB

    def row(what: str, measured: float, planned: float) -> None:
        print(f"{what:<52} measured {measured / MiB:8.1f} MiB   planned {planned / MiB:8.1f} MiB   "
              f"ratio {measured / planned:5.2f}")

    runtime = child(RUNTIME)
    row("rank process after imports (RSS)", runtime["rss"], RUNTIME_BYTES)
    if "rss_cuda" in runtime:
        row(f"... and a CUDA context on {runtime['device']}", runtime["rss_cuda"], RUNTIME_BYTES)
    for precision in ("fp32", "bf16"):
        spec = fill_defaults({
            "model": {"architecture": "llama", "task": "causal-lm", "config": {
                "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
                "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 128,
                "vocab_size": args.vocab, "max_position_embeddings": 2048}},
            "data": {"synthetic": {"seq_len": 128}}, "memory": {"precision": precision}})
        derived = derive(spec, profiler=job_profiler())
        assert derived.profile is not None
        inventory = derived.profile.inventory
        planned = construction_bytes(inventory, stage=2, world=1, lp=derived.precision_bytes)
        for how in ("jobspec", "from_config"):
            result = child(BUILD, json.dumps(spec), how, json.dumps(compile_spec(spec, derived).ds_config))
            label = f"{precision} job, {result['params'] / 1e6:.0f}M params, {how} ({'/'.join(result['dtypes'])})"
            row(label, result["growth"], planned)
    uss = child(WORKERS)["uss"]
    for i, value in enumerate(uss):
        row(f"DataLoader worker {i} (USS, 50 batches of 8 x 512)", value, DATALOADER_WORKER_BYTES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
