"""Memory vs checkpointing for jobspec's deep MLP (issue 7): one layer in k vs segments of layers.

    python bench/checkpoint_segments.py                        # CPU size: hidden 256, batch 1024, seq 1
    python bench/checkpoint_segments.py --hidden 4096 --batch 32768   # the jobs' size (a GPU)
    python bench/checkpoint_segments.py --sequential 2,4,8,10,16 --repeats 3

Two ways to checkpoint the same 16 `layers` (Linear(h, h) + ReLU each):
- `every k` is jobspec's `memory.activation_checkpointing: {every_n_layers: k}` (the patch wraps
  each layer i % k == 0 in checkpoint(): "checkpoint one layer in every k");
- `segments S` is `torch.utils.checkpoint.checkpoint_sequential(layers, S, x)`, the experiment of
  seed 004: S runs of consecutive layers, each keeping only its input (the last run is not
  checkpointed), and one run recomputed at a time in backward.

Per row, one training step (forward + backward), measured on any device:
- saved MiB: bytes of every tensor autograd saves for backward (`saved_tensors_hooks`), unique
  storages, parameters excluded; exact;
- live-saved peak MiB: the most of those alive at once during forward + backward;
- peak MiB: the most bytes of all tensors alive at once during the step (every tensor an op creates,
  recomputed ones and gradients included, tracked by a TorchDispatchMode until its storage is freed):
  the CPU stand-in for `torch.cuda.max_memory_allocated` minus what existed before the step;
- recomputed: layer forwards run again in backward, as a fraction of one forward;
- step time relative to no checkpointing (fastest of --repeats, after a warm-up step);
- planner: `jobspec.memory.planner` activations (layers + embeddings + logits) for the every-k rows;
- on CUDA also `torch.cuda.max_memory_allocated` minus the memory allocated before the step.
"""
from __future__ import annotations

import argparse
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402

from jobspec.model.mlp import MLPClassifier, MLPConfig  # noqa: E402
from jobspec.model.structure import checkpoint_every_nth_layer  # noqa: E402
from jobspec.units import MiB  # noqa: E402

VOCAB, LABELS = 1024, 2


class SavedTensors:
    """Counts what autograd saves for backward: unique storages, and the peak of those alive at once."""

    def __init__(self, model):
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}      # data_ptr -> nbytes, every storage ever saved
        self.live: dict[int, int] = {}          # data_ptr -> number of saved references alive
        self.live_bytes = self.peak = 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.parameters:
            return tensor
        self.storages[key] = storage.nbytes()
        if not self.live.get(key):
            self.live_bytes += storage.nbytes()
            self.peak = max(self.peak, self.live_bytes)
        self.live[key] = self.live.get(key, 0) + 1
        return _Saved(tensor, self, key, storage.nbytes())

    def release(self, key: int, nbytes: int) -> None:
        self.live[key] -= 1
        if not self.live[key]:
            self.live_bytes -= nbytes

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class _Saved:
    """A saved tensor; autograd drops it when the node that needs it has run (or the graph is freed)."""

    def __init__(self, tensor, counter: SavedTensors, key: int, nbytes: int):
        self.tensor = tensor
        weakref.finalize(self, counter.release, key, nbytes)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by ops while active, each counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.seen = WeakIdKeyDictionary()
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage) -> None:
        if storage in self.seen or storage.nbytes() == 0:
            return
        self.seen[storage] = True
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, storage.nbytes())

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes


def build(hidden: int, layers: int, device, every: int | None = None, segments: int | None = None):
    torch.manual_seed(0)
    model = MLPClassifier(MLPConfig(hidden_size=hidden, num_layers=layers, vocab_size=VOCAB,
                                    num_labels=LABELS)).to(device).train()
    if every:
        checkpoint_every_nth_layer(model, every)
    if segments:
        def forward_layers(hidden_states):
            return torch.utils.checkpoint.checkpoint_sequential(model.layers, segments, hidden_states,
                                                                use_reentrant=False)
        model.run_layers = forward_layers
    return model


def step(model, batch) -> None:
    """One forward + backward; `run_layers` (segments mode) replaces the loop over the layers."""
    if hasattr(model, "run_layers"):
        tokens = model.embeddings(batch["input_ids"])
        hidden = model.run_layers(tokens.mean(dim=1))
        loss = torch.nn.functional.cross_entropy(model.classifier(hidden), batch["labels"])
    else:
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def recomputed_fraction(model, batch) -> float:
    calls: list[int] = []
    handles = [next(layer.children()).register_forward_pre_hook(lambda *_, i=i: calls.append(i))
               for i, layer in enumerate(model.layers)]
    if hasattr(model, "run_layers"):
        tokens = model.embeddings(batch["input_ids"])
        loss = model.classifier(model.run_layers(tokens.mean(dim=1))).logsumexp(-1).mean()
    else:
        loss = model(**batch).loss
    forward = len(calls)
    loss.backward()
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return (len(calls) - forward) / forward


def measure(model, batch, repeats: int) -> dict:
    step(model, batch)    # warm-up: lazy inits, allocator, oneDNN kernels
    saved = SavedTensors(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step(model, batch)
    live = LiveBytes()
    with live:
        step(model, batch)
    row = {"saved": saved.total, "saved_peak": saved.peak, "peak": live.peak,
           "recomputed": recomputed_fraction(model, batch)}
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, batch)
        torch.cuda.synchronize()
        row["cuda_peak"] = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(model, batch)
        if batch["input_ids"].is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    row["seconds"] = min(times)   # the least-disturbed run: the machine may be shared
    return row


def planner_activations(hidden: int, layers: int, batch: int, seq: int, every: int | None) -> int:
    """What jobspec's planner predicts for the same model and batch (the traced activation peak)."""
    from jobspec.model.planner_trace import ModelTracer
    from jobspec.spec.schema import fill_defaults

    spec = fill_defaults({"model": {"architecture": "mlp", "num_labels": LABELS,
                                    "config": {"hidden_size": hidden, "num_layers": layers, "vocab_size": VOCAB}},
                          "data": {"synthetic": {"seq_len": seq}}, "training": {"micro_batch_size": batch},
                          "memory": {"activation_checkpointing": {"every_n_layers": every} if every else False}})
    return ModelTracer(spec).profile("fp32", batch, seq, spec["memory"]["activation_checkpointing"]).activations.peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (jobs: 4096)")
    parser.add_argument("--layers", type=int, default=16, help="number of Linear+ReLU layers")
    parser.add_argument("--batch", type=int, default=1024, help="micro-batch (jobs: 32768)")
    parser.add_argument("--seq", type=int, default=1,
                        help="tokens per sample (jobs: 8); the (batch, seq, hidden) embedding output is transient")
    parser.add_argument("--every", default="1,2,4,8,16", help="every_n_layers values (comma-separated)")
    parser.add_argument("--sequential", default="2,4,8,10,16", metavar="SEGMENTS",
                        help="checkpoint_sequential segment counts (comma-separated; empty: none)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row (the fastest counts)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, VOCAB, (args.batch, args.seq), generator=generator).to(device),
             "labels": torch.randint(0, LABELS, (args.batch,), generator=generator).to(device)}
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    rows = [("off", {}, None)] + [(f"every {k}", {"every": k}, k) for k in ints(args.every)]
    rows += [(f"segments {s}", {"segments": s}, None) for s in ints(args.sequential)]
    cuda = device.type == "cuda"
    print(f"deep MLP: {args.layers} x Linear({args.hidden}, {args.hidden}) + ReLU, batch {args.batch}, "
          f"seq {args.seq}, fp32, {device.type}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"one (batch, hidden) matrix = {4 * args.batch * args.hidden / MiB:.1f} MiB\n")
    header = ["checkpointing", "saved MiB", "live-saved peak MiB", "peak MiB", "recomputed", "step time"]
    header += ["planner MiB"] + (["CUDA peak MiB"] if cuda else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    reference = None
    for label, options, every in rows:
        row = measure(build(args.hidden, args.layers, device, **options), batch, args.repeats)
        reference = reference or row["seconds"]
        planned = (planner_activations(args.hidden, args.layers, args.batch, args.seq, every)
                   if not options.get("segments") else None)
        cells = [label, f"{row['saved'] / MiB:.2f}", f"{row['saved_peak'] / MiB:.2f}", f"{row['peak'] / MiB:.2f}",
                 f"{row['recomputed']:.2f}", f"{row['seconds'] / reference:.2f}x",
                 f"{planned / MiB:.2f}" if planned is not None else "-"]
        if cuda:
            cells.append(f"{row['cuda_peak'] / MiB:.2f}")
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
