"""Chat data at scale: time to the first training step and peak host RSS per rank, cold and warm cache.

    python -m bench.data_prep                               # 10^4 and 10^5 records, 1 and 2 ranks
    python -m bench.data_prep --records 1000000 --ranks 2   # one size, one world size
    python -m bench.data_prep --prepare-only --records 100000 --num-proc 1 2   # records/s of the pass alone
    python -m bench.data_prep --arrow CACHE_ENTRY_DIR   # the entry's NumPy memmaps against the same columns in Arrow

For each size, synthetic chat records (bench/chat_data.py: 1-3 exchanges, questions of 10-60 words,
answers of 20-200) and a tiny Qwen2-shaped LoRA job on the shipped sample tokenizer (jobs/data/tokenizer,
max_length 256: most conversations are truncated), 3 steps. For each world size, a launch with an empty
data cache (cold: the launcher tokenises every record before the ranks start) and the same launch
again (warm: the ranks map the entry). Per launch:

- time to the first step: the launcher process's start to rank 0's `first-step` mark (launcher.log);
- the launcher's data phase (its `planned` to `data` marks) and the ranks' (`model` to `data`);
- peak RSS per rank, two ways: polled with psutil over the worker processes (the bench's own view)
  and the run's `mem/host_rss_mib_max` (summary.json, rank 0's sampler);
- the pass's records/s (the cache entry's meta.json) and the load average before the launch (the
  machine is shared: other work slows every number).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASE = re.compile(r"^jobspec-log: phase (\S+) (\S+) ([0-9.]+) ([0-9.]+)$", re.M)
JOB = """\
name: chat-scale
model:
  architecture: qwen2
  task: causal-lm
  config: {{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, vocab_size: 2048, max_position_embeddings: 512}}
  lora: {{r: 8}}
data:
  train: {data}
  tokenizer: {tokenizer}
  records: chat
  loss_on: answers
  max_length: 256
training:
  max_steps: 3
  micro_batch_size: 2
  global_batch_size: {global_batch}
memory: {{precision: fp32}}
resources: {{gpus_per_node: {ranks}}}
checkpoint: {{resume: never}}
export: {{final: false}}
logging: {{mlflow: {{enabled: false}}, progress: lines}}
output_dir: {out}
"""


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def data_file(work: Path, records: int) -> Path:
    from bench.chat_data import write_chat_records

    path = work / f"chat-{records}.jsonl"
    if not path.exists():
        write_chat_records(path, records)
    return path


def write_job(work: Path, data: Path, ranks: int) -> Path:
    job = work / f"{data.stem}-{ranks}r.yaml"
    job.write_text(JOB.format(data=data, tokenizer=REPO / "jobs" / "data" / "tokenizer", ranks=ranks,
                              global_batch=2 * ranks, out=work / "out" / job.stem))
    return job


def launch(job: Path, cache: Path) -> dict:
    """One launch; its marks, the workers' peak RSS (psutil) and the summary's."""
    import psutil

    env = {**os.environ, "JOBSPEC_CACHE_DIR": str(cache)}
    load = load_average()
    proc = subprocess.Popen([sys.executable, "-m", "jobspec", "launch", str(job), "--new-run"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            for child in parent.children(recursive=True):
                if "jobspec.train.worker" in " ".join(child.cmdline()):
                    peaks[child.pid] = max(peaks.get(child.pid, 0), child.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.1)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"{job} failed ({proc.returncode}):\n{output[-4000:]}")
    run_dir = max((job.parent / "out" / job.stem).glob("run-*"))
    marks = {f"{who}/{name}": float(at) for who, name, at, _ in
             PHASE.findall((run_dir / "launcher.log").read_text(errors="replace"))}
    summary = json.loads((run_dir / "summary.json").read_text())
    rate = re.search(r"tokenised data\.train: ([0-9,]+) records in ([0-9.]+) s \(([0-9,]+) records/s\)", output)
    return {"load": load, "first_step_s": marks["rank0/first-step"] - marks["launcher/start"],
            "launcher_data_s": marks["launcher/data"] - marks["launcher/planned"],
            "rank_data_s": marks["rank0/data"] - marks["rank0/model"],
            "rss_polled_mib": max(peaks.values()) / 2**20 if peaks else None,
            "rss_summary_mib": summary["peak_memory"].get("mem/host_rss_mib_max"),
            "prep_records_per_s": int(rate.group(3).replace(",", "")) if rate else None}


def prepare_only(work: Path, records: int, num_procs: list[int]) -> None:
    """The pass alone (jobspec prepare --data-only), each process count with an empty cache."""
    data = data_file(work, records)
    job = write_job(work, data, 1)
    print("| records | processes | seconds | records/s | CPU seconds | records per CPU second | load before |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for procs in num_procs:
        cache = Path(tempfile.mkdtemp(dir=work, prefix="cache-"))
        load = load_average()
        subprocess.run([sys.executable, "-m", "jobspec", "prepare", str(job), "--data-only",
                        "--set", f"data.num_proc={procs}"], check=True, capture_output=True,
                       env={**os.environ, "JOBSPEC_CACHE_DIR": str(cache)})
        meta = json.loads(next(cache.glob("data/[!.]*/meta.json")).read_text())
        cpu = meta["cpu_seconds"]
        print(f"| {records:,} | {procs} | {meta['seconds']:.1f} | {records / meta['seconds']:,.0f} | {cpu:.1f} | "
              f"{records / cpu:,.0f} | {load} |", flush=True)


def compare_arrow(entry: Path, work: Path, samples: int = 2000) -> None:
    """Open an entry and read `samples` random samples: its memmaps (this process) against the same
    columns saved by `datasets` (save_to_disk / load_from_disk, numpy format) in a fresh process, whose
    `import datasets` a rank would pay too."""
    import random

    import numpy as np

    from jobspec.data import cache as data_cache

    started = time.perf_counter()
    cached = data_cache.open_entry(entry.name, entry.parent)
    assert cached is not None, f"{entry} is not a cache entry"
    opened = time.perf_counter() - started
    chosen = random.Random(0).sample(range(len(cached)), samples)
    started = time.perf_counter()
    for i in chosen:
        ids, labels = cached.sample(i)
        ids.astype(np.int64), labels.astype(np.int64)
    read = time.perf_counter() - started
    print(f"memmap: open {opened * 1e3:.1f} ms, {samples} random samples {read * 1e3:.0f} ms, "
          f"{cached.nbytes / 2**20:.0f} MiB")
    arrow = work / f"arrow-{entry.name}"
    if not arrow.exists():
        import datasets

        offsets = np.asarray(cached.offsets)
        columns = {name: [np.asarray(getattr(cached, name)[offsets[i]:offsets[i + 1]]) for i in range(len(cached))]
                   for name in ("input_ids", "labels")}
        datasets.Dataset.from_dict(columns).save_to_disk(str(arrow))
    code = f"""
import random, time
started = time.perf_counter(); import datasets; imported = time.perf_counter() - started
started = time.perf_counter(); table = datasets.load_from_disk({str(arrow)!r}).with_format("numpy")
opened = time.perf_counter() - started
chosen = random.Random(0).sample(range(len(table)), {samples})
started = time.perf_counter()
for i in chosen:
    table[i]
read = time.perf_counter() - started
print(f"arrow: import datasets {{imported * 1e3:.0f}} ms, open {{opened * 1e3:.1f}} ms, {samples} random samples "
      f"{{read * 1e3:.0f}} ms")
"""
    print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip())
    size = sum(f.stat().st_size for f in arrow.rglob("*") if f.is_file())
    print(f"arrow: {size / 2**20:.0f} MiB on disk; load {load_average()}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work", type=Path, default=REPO / "bench" / "work" / "data_prep")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--arrow", type=Path, metavar="CACHE_ENTRY_DIR",
                        help="compare an entry's memmaps with the same columns in Arrow (datasets)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.arrow:
        compare_arrow(args.arrow, args.work)
        return 0
    if args.prepare_only:
        for records in args.records:
            prepare_only(args.work, records, args.num_proc)
        return 0
    print("| records | ranks | cache | first step (s) | launcher data (s) | rank data (s) | "
          "peak RSS/rank polled (MiB) | summary (MiB) | prep records/s | load before |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)
    for records in args.records:
        data = data_file(args.work, records)
        for ranks in args.ranks:
            job = write_job(args.work, data, ranks)
            cache = Path(tempfile.mkdtemp(dir=args.work, prefix="cache-"))
            for state in ("cold", "warm"):
                r = launch(job, cache)
                rate = f"{r['prep_records_per_s']:,}" if r["prep_records_per_s"] else "-"
                print(f"| {records:,} | {ranks} | {state} | {r['first_step_s']:.1f} | {r['launcher_data_s']:.1f} | "
                      f"{r['rank_data_s']:.2f} | {r['rss_polled_mib']:.0f} | {r['rss_summary_mib']:.0f} | {rate} | "
                      f"{r['load']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
