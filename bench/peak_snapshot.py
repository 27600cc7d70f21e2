"""What was live on the GPU at a training step's peak, from torch's allocator history, in coarse terms.

`torch.cuda.memory._snapshot()`, taken with `_record_memory_history` on, holds the allocator's blocks
at that moment (`segments`) and its events since recording began (`device_traces`). Walking the events
backwards from the blocks live now gives the blocks live when recording began; replaying them forwards
gives the allocated total after every event (`alloc` adds a block, `free_requested` takes it off, the
moments `torch.cuda.max_memory_allocated` counts), its maximum and the blocks live at that moment. The
events carry the bytes asked for, not the allocator's rounded blocks, so the sizes here are requested
bytes throughout: the peak is a little under torch's maximum of the same step.

A block allocated while recording carries the Python stack of its allocation: it is grouped as
"activations and temporaries" by phase (forward, backward, optimizer step) and the innermost frame
outside torch (the model's module, DeepSpeed, jobspec). A block from before recording (parameters,
optimizer states, DeepSpeed's flat buffers) has no stack: it is named by the tensor whose storage starts
inside it (`TensorRanges`, filled from the engine). Pure functions over plain dicts: no torch import,
so tests/test_gpu_calibrate.py checks them on a made-up history.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

GiB = 2**30
ACTIVATIONS = "activations and temporaries"
BEFORE = "other, live before the step"
FRAMES_KEPT = 8          # frames per listed allocation: enough to see the module and the call into it
TORCH_PART = "/torch/"   # frames inside torch's own Python code say nothing about the model


@dataclass
class TensorRanges:
    """Storages of known tensors (address, bytes) with their term ("parameters", "gradients", ...) and
    name; the first name given to a storage stays."""

    starts: list[int] = field(default_factory=list)
    entries: list[tuple[int, int, str, str]] = field(default_factory=list)   # sorted by start

    def add(self, start: int, nbytes: int, term: str, name: str) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.starts) and self.starts[i] == start:
            return
        self.starts.insert(i, start)
        self.entries.insert(i, (start, nbytes, term, name))

    def find(self, address: int, size: int) -> tuple[str, str] | None:
        """(term, name) of the first known storage that starts inside the block [address, address + size)."""
        i = bisect.bisect_left(self.starts, address)
        if i < len(self.starts) and self.starts[i] < address + size:
            _, _, term, name = self.entries[i]
            return term, name
        return None


def live_now(snapshot: dict) -> dict[int, dict]:
    """address -> block ({size: requested bytes, frames}) of every block allocated at the snapshot."""
    return {b["address"]: {"size": b.get("requested_size", b["size"]), "frames": b.get("frames") or []}
            for segment in snapshot.get("segments", []) for b in segment.get("blocks", [])
            if b.get("state") == "active_allocated"}


def live_at_start(now: dict[int, dict], trace: list[dict]) -> dict[int, dict]:
    """The blocks live before the first event of `trace`, from those live after its last."""
    live = dict(now)
    for event in reversed(trace):
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_requested":
            live[event["addr"]] = {"size": event["size"], "frames": event.get("frames") or [], "before": True}
    for block in live.values():
        block.setdefault("before", True)   # live before recording began: no allocation event of its own
    return live


def live_at_peak(start: dict[int, dict], trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """(allocated bytes at the peak, the blocks live then), replaying `trace` from `start`."""
    total = peak = sum(b["size"] for b in start.values())
    peak_at = -1
    for i, event in enumerate(trace):
        total += _delta(event)
        if total > peak:
            peak, peak_at = total, i
    live = dict(start)
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = {"size": event["size"], "frames": event.get("frames") or [], "before": False}
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return peak, live


def _delta(event: dict) -> int:
    return {"alloc": event["size"], "free_requested": -event["size"]}.get(event["action"], 0)


def phase(frames: list[dict]) -> str:
    """forward, backward (autograd: checkpointed layers recompute there too) or optimizer step."""
    names = [(f.get("filename", ""), f.get("name", "")) for f in frames]
    if any("autograd" in path and name in ("backward", "_engine_run_backward") for path, name in names):
        return "backward"
    if any(name == "step" and ("optim" in path or "deepspeed" in path) for path, name in names):
        return "optimizer step"
    return "forward"


def site(frames: list[dict], skip: str = TORCH_PART) -> str:
    """The innermost frame outside torch, as `package/path.py:function`."""
    for frame in frames:
        path = frame.get("filename", "")
        if skip not in path and not path.startswith("<"):
            return f"{short_path(path)}:{frame.get('name', '?')}"
    return "torch" if frames else "unknown"


def short_path(path: str) -> str:
    """A frame's file from its package on (site-packages/transformers/models/... -> transformers/models/...)."""
    for marker in ("site-packages/", "dist-packages/", "/jobspec/", "/bench/"):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail if marker.endswith("-packages/") else marker.strip("/") + "/" + tail
    return path


def classify(block: dict, address: int, ranges: TensorRanges, skip: str = TORCH_PART) -> tuple[str, str]:
    """(term, what): a known tensor's term and name, else activations by phase and site, else BEFORE."""
    known = ranges.find(address, block["size"])
    if known is not None:
        return known
    if not block["before"] and block["frames"]:
        return ACTIVATIONS, f"{phase(block['frames'])}: {site(block['frames'], skip)}"
    return BEFORE, site(block["frames"], skip) if block["frames"] else "no stack (allocated before recording)"


def breakdown(snapshot: dict, ranges: TensorRanges, device: int = 0, top: int = 20,
              skip: str = TORCH_PART) -> dict:
    """The step's peak from the history: total, bytes by term, activations by phase and site, the
    `top` largest live blocks with their frames (GiB, sizes in MiB)."""
    trace = snapshot.get("device_traces", [[]])[device] if snapshot.get("device_traces") else []
    peak, live = live_at_peak(live_at_start(live_now(snapshot), trace), trace)
    terms: dict[str, int] = {}
    sites: dict[str, int] = {}
    rows = []
    for address, block in live.items():
        term, what = classify(block, address, ranges, skip)
        terms[term] = terms.get(term, 0) + block["size"]
        if term == ACTIVATIONS:
            sites[what] = sites.get(what, 0) + block["size"]
        rows.append((block["size"], term, what, block["frames"]))
    rows.sort(key=lambda r: -r[0])
    return {
        "peak_requested_gib": round(peak / GiB, 3),
        "trace_events": len(trace),
        "terms_gib": {k: round(v / GiB, 3) for k, v in sorted(terms.items(), key=lambda kv: -kv[1])},
        "activations_by_site_gib": {k: round(v / GiB, 3) for k, v in
                                    sorted(sites.items(), key=lambda kv: -kv[1])[:top]},
        "largest": [{"mib": round(size / 2**20, 1), "term": term, "what": what,
                     "frames": [f"{short_path(f.get('filename', '?'))}:{f.get('line', '?')}:{f.get('name', '?')}"
                                for f in frames[:FRAMES_KEPT]]}
                    for size, term, what, frames in rows[:top]],
    }
