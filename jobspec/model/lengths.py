"""The planner's timeline at a long sequence from its traces at three short ones (model/step.py).

A traced step is a list of events: a storage allocated (+bytes) or freed (-bytes). From one length
to another its ops are the same but for the tile loops of the long-sequence techniques (DeepSpeed's
`TiledMLP` and `SequenceTiledCompute`, model/tiling.py), which run more tiles at longer lengths;
and each dimension of every tensor allocated is an affine function of one quantity: the length s,
s rounded up to 128 (the flash kernel's backward scratch) or, for a tensor made in a tile loop,
that loop's tile count, its tiles' length or its last tile's length. Sizes are then polynomials in
s (s² for eager attention's scores and padding masks: two dimensions of s), but inside tile loops,
where a tile holds ceil(s / tiles) tokens. So:

- the trace records each allocation's shape (`storage_shape`), where each tile loop runs and how
  long each of its tiles is (`tile_loops`);
- `canonical` cuts a timeline into what runs outside tile loops and, per loop, its first tile, one
  middle tile (the middle tiles are alike) and its last tile with what follows it up to the loop's
  end; consecutive frees of storages made at the same place of successive tiles are one event and
  a count;
- three timelines of the same parts give every dimension and count as an affine function of one
  quantity, fitted through two lengths and checked at the third (`_explain`), and the timeline at s
  is rebuilt from them with its own tile counts (`TileRules`: the tiling code's rules, checked
  against every traced loop). What does not fit (other parts, a dimension no quantity explains, two
  explanations that disagree at s, a tile loop of fewer than 3 tiles) gives None: s is traced.

The FLOPs are a quadratic in s through the three (the tiles' products add up to the untiled ones).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from fractions import Fraction

LENGTH_QUANTUM = 64    # interpolated lengths are multiples of this (the kernels round to 32, 128)
FLASH_ROUND = 128      # the flash kernel's backward scratch holds s rounded up to this
ALLOCATOR_ROUND = 512  # the CUDA caching allocator's smallest block
_ULYSSES = "deepspeed.runtime.sequence_parallel.ulysses_sp"
_TILED = {"TiledMLP": "mlp", "SequenceTiledCompute": "loss"}   # DeepSpeed's tiled functions
_MIN_TILES = 3         # a first, a middle and a last tile
_BASIS_TOP = 1 << 17   # the longest length traced for interpolation
_BASIS_TRIES = 8       # lengths tried for each of the three
_LATER = 6             # of the 8 `_later` lengths, at least these many with regular tiles


# ------------------------------------------------------------------ what the trace records
def storage_shape(tensor, nbytes: int) -> list[int]:
    """[bytes per element, *dimensions] of a new storage held whole by `tensor`, else [1, bytes]."""
    itemsize = tensor.element_size()
    if tensor.numel() * itemsize == nbytes:
        return [itemsize, *(int(d) for d in tensor.shape)]
    return [1, nbytes]


class tile_loops:
    """Marks DeepSpeed's tile loops in a traced step (`counter.loops`: [kind, first event, end
    event, [[first event of a tile, its length], ...]]) by wrapping its tiled functions while
    tracing. Only when model/tiling.py's patches have loaded DeepSpeed
    (planner_trace.apply_techniques)."""

    def __init__(self, counter):
        self.counter = counter
        self._originals: dict = {}

    def __enter__(self):
        module = sys.modules.get(_ULYSSES)
        if module is None:
            return self
        for name, kind in _TILED.items():
            original = getattr(module, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(module, name, _marked(original, kind, self.counter))
        return self

    def __exit__(self, *exc):
        module = sys.modules.get(_ULYSSES)
        for name, original in self._originals.items():
            setattr(module, name, original)
        return False


def _marked(original, kind: str, counter):
    """`original` (a tiled autograd function) with its forward and backward loops marked."""
    import torch

    class Marked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fn, *args):
            with _loop(counter, f"{kind}.forward"):
                return original.forward(ctx, _tile(fn, counter), *args)

        @staticmethod
        def backward(ctx, *grads):
            with _loop(counter, f"{kind}.backward"):
                return original.backward(ctx, *grads)   # calls the marked fn the forward stored

    return Marked


class _loop:
    """One run of a tiled function's loop. They nest: a checkpointed layer's backward loop first
    unpacks its input, which recomputes the layer, whose forward loop runs inside it."""

    def __init__(self, counter, kind: str):
        self.counter, self.kind = counter, kind

    def __enter__(self):
        self.outer = self.counter.open_loop
        self.record = [self.kind, len(self.counter.events), None, []]
        self.counter.open_loop = self.record
        return self

    def __exit__(self, *exc):
        self.record[2] = len(self.counter.events)
        self.counter.loops.append(self.record)
        self.counter.open_loop = self.outer
        return False


def _tile(fn, counter):
    """`fn`, noting where each call (a tile) starts and how many tokens it holds."""
    import torch

    def tile(*args, **kwargs):
        loop = counter.open_loop
        if loop is not None:   # the sharded input: (batch, tokens, hidden) or (rows, hidden)
            sharded = next(a for a in (*args, *kwargs.values())
                           if torch.is_tensor(a) and a.dim() > 1)
            loop[3].append([len(counter.events), int(sharded.shape[-2])])
        return fn(*args, **kwargs)

    return tile


# ------------------------------------------------------------------ the tiling code's rules
@dataclass(frozen=True)
class TileRules:
    """The tiles model/tiling.py and DeepSpeed cut a sequence into (checked against every trace)."""

    mlp_hidden: int | None = None   # tiled MLP: ceil(s / hidden_size) tiles, cut by torch.chunk
    loss_tiles: int | None = None   # tiled loss: this many tiles, or ...
    loss_vocab: int | None = None   # ... as many as keep one tile's logits within the bound

    @property
    def tiled(self) -> bool:
        return bool(self.mlp_hidden or self.loss_tiles or self.loss_vocab)

    @property
    def fixed(self) -> frozenset:
        """The kinds of loop whose tile count does not grow with the length."""
        return frozenset(("loss.forward", "loss.backward") if self.loss_tiles else ())

    def tile_count(self, batch: int, length: int) -> int:
        """Tiles of every kind at this length (a trace's time grows with them)."""
        return sum(count for count, _, _ in self.tiles(batch, length).values())

    def tiles(self, batch: int, length: int) -> dict[str, tuple[int, int, int]]:
        """Each tile loop's (tile count, tile length, last tile's length) at this micro-batch and
        length, by kind; a last length <= 0: empty tiles at the end."""
        from jobspec.model.tiling import default_tiles

        out = {}
        if self.mlp_hidden:   # torch.chunk into ceil(s / hidden) pieces of ceil(rows / pieces) rows
            pieces = max(1, -(-length // self.mlp_hidden))
            # the backward chunks batch x seq rows
            for kind, rows in (("mlp.forward", length), ("mlp.backward", batch * length)):
                size = -(-rows // pieces)
                count = -(-rows // size)
                out[kind] = (count, size, rows - (count - 1) * size)
        if self.loss_tiles or self.loss_vocab:   # `shards` slices of ceil(s / shards) tokens
            bound = default_tiles(batch * length, self.loss_vocab or 1)
            shards = min(length, self.loss_tiles or bound)
            step = -(-length // shards)
            tiles = (shards, step, length - (shards - 1) * step)
            out["loss.forward"] = out["loss.backward"] = tiles
        return out

    def chunks(self, batch: int, length: int) -> dict[str, list[int]]:
        """Each tile loop's tile lengths, by kind (what the trace records)."""
        return {kind: [max(0, min(size, (count - 1) * size + last - i * size))
                       for i in range(count)]
                for kind, (count, size, last) in self.tiles(batch, length).items()}


def _quantities(rules: TileRules, batch: int, length: int) -> dict[str, dict[str, int]] | None:
    """The quantities a dimension may follow: "" (outside tile loops): s and s rounded to 128; per
    loop kind, those and the tile count T, the tile length c and the last tile's cl. None when a
    loop has fewer than 3 tiles or empty ones."""
    base = {"s": length, "s128": -(-length // FLASH_ROUND) * FLASH_ROUND}
    out = {"": base}
    for kind, (count, size, last) in rules.tiles(batch, length).items():
        if count < _MIN_TILES or last <= 0:
            return None
        out[kind] = {**base, "T": count, "c": size, "cl": last}
    return out


# ------------------------------------------------------------------ the three lengths traced
def basis_lengths(rules: TileRules, batch: int, positions: int | None
                  ) -> tuple[int, int, int] | None:
    """Three lengths to trace, within the model's positions, as short as they can be: a trace's
    time grows with its tiles. Of both residues modulo 128 (so that s and s rounded to 128 tell
    apart), and with tile counts that differ at each (so that a count and what follows it fit)."""
    if not rules.tiled:
        for unit in (512, 256, 128):
            if positions is None or 4 * unit <= positions:
                return 2 * unit, 3 * unit + LENGTH_QUANTUM, 4 * unit
        return None
    top = min(positions or _BASIS_TOP, _BASIS_TOP)
    known: dict[int, dict | None] = {}

    def quantities(length: int) -> dict | None:
        if length not in known:
            known[length] = _quantities(rules, batch, length) if length <= top else None
        return known[length]

    def after(length: int, tries: int, other: int | None = None) -> list[int]:
        """The first lengths past `length` whose tile counts differ from its (and `other`'s)."""
        out = []
        for s in range(length + LENGTH_QUANTUM, top + 1, LENGTH_QUANTUM):
            q = quantities(s)
            earlier = [quantities(x) for x in (length, other) if x is not None]
            if q is not None and all(_other_tiles(q, e, rules.fixed) for e in earlier):
                out.append(s)
                if len(out) == tries:
                    break
        return out

    firsts = [s for s in range(2 * LENGTH_QUANTUM, top + 1, LENGTH_QUANTUM) if quantities(s)]
    for s1 in firsts[:_BASIS_TRIES]:
        for s2 in after(s1, 2 * _BASIS_TRIES):
            for s3 in after(s2, 4 * _BASIS_TRIES, s1):
                later = [q for q in (_quantities(rules, batch, s) for s in _later(s3)) if q]
                if _distinguishes([quantities(s1), quantities(s2), quantities(s3)], later):
                    return s1, s2, s3
    return None


def _later(length: int) -> list[int]:
    """Longer lengths of every residue modulo 256, where a relation between two quantities that
    holds at all of them is taken for a rule (a tile count of s / 64), not a coincidence."""
    return [k * length + j * LENGTH_QUANTUM for k in (2, 5) for j in range(4)]


def _other_tiles(one: dict | None, other: dict | None, fixed: frozenset) -> bool:
    """Every tile loop runs another number of tiles at the two lengths (but a fixed count)."""
    if one is None or other is None:
        return False
    return all(one[kind]["T"] != other[kind]["T"] for kind in one if kind and kind not in fixed)


def _distinguishes(quantities: list, later: list[dict]) -> bool:
    """Over the three lengths s and s rounded to 128 take three values, and so does each tile
    loop's quantity, or one value also at the `later` lengths (tiles of a model's hidden size when
    it divides 64, a fixed tile count): so each fit is checked at a third point, and a constant
    stays one; and no two quantities that vary are affine in each other, unless they are at the
    later lengths too (a tile count of s / 64): else a dimension would have two explanations."""
    if len({q[""]["s128"] - q[""]["s"] for q in quantities}) == 1:
        return False   # one residue modulo 128
    for kind in quantities[0]:
        names = list(quantities[0][kind])
        vectors = {name: [q[kind][name] for q in quantities] for name in names}
        for name, v in vectors.items():
            fixed = kind != "" and len(later) >= _LATER \
                and all(q[kind][name] == v[0] for q in later)
            if len(set(v)) != 3 and not (len(set(v)) == 1 and fixed):
                return False
        varying = [name for name in names if len(set(vectors[name])) == 3]
        for i, u in enumerate(varying):
            for v in varying[i + 1:]:
                us, vs = vectors[u], vectors[v]
                slope = Fraction(vs[2] - vs[0], us[2] - us[0])
                if vs[1] - vs[0] != slope * (us[1] - us[0]):
                    continue
                if len(later) < _LATER or any(q[kind][v] - vs[0] != slope * (q[kind][u] - us[0])
                                              for q in later):
                    return False
    return True


# ------------------------------------------------------------------ a timeline's parts
@dataclass
class _Form:
    """A timeline in parts: ("glue", runs) outside tile loops, ("backward",) where the backward
    starts, ("loop", kind, [runs of the first tile, of a middle tile, of the last tile and what
    follows it up to the loop's end]). A loop starts at its first tile: what comes before (a
    checkpointed layer's recompute, unpacked by a backward loop) is glue. A run: [first event,
    count, where its storage was made: "" outside loops, else "kind:last" (tile) or "kind:tile"]."""

    timeline: dict
    parts: list
    chunks: dict   # kind -> the tile lengths of that kind's loops (all alike, else no form)

    def shape(self, event: int) -> list[int]:
        return self.timeline["shapes"][self.timeline["serials"][event]]


def canonical(timeline: dict) -> _Form | None:
    """`timeline` in parts, or None: no shapes or loops recorded (an old cache entry), a loop of
    fewer than 3 tiles or with unlike middle tiles, loops of one kind with other tiles, the backward
    inside a loop."""
    if "shapes" not in timeline or "loops" not in timeline:
        return None
    if any(len(tiles) < _MIN_TILES for _, _, _, tiles in timeline["loops"]):
        return None
    loops = sorted(([kind, tiles[0][0], end, tiles] for kind, _, end, tiles in timeline["loops"]),
                   key=lambda loop: loop[1])
    serials, shapes = timeline["serials"], timeline["shapes"]
    sizes, codes = timeline["sizes"], timeline["regions"]
    # where each storage was made: outside loops ("", its event), or in a loop's last tile or in
    # another (the two told apart even where the tiles are alike), and its place in that tile.
    # Frees of storages made at the same place of successive tiles are alike (a run: their count
    # follows the tile count); no two allocations are, nor two frees of storages made outside.
    places: list = [("", i) for i in range(len(sizes))]
    for kind, begin, end, tiles in loops:
        starts = [start for start, _ in tiles] + [end]
        for number, (low, high) in enumerate(zip(starts, starts[1:])):
            place = f"{kind}:last" if number == len(tiles) - 1 else f"{kind}:tile"
            places[low:high] = [(place, i - low) for i in range(low, high)]
    homes = [places[serial][0] for serial in serials]
    keys = [(size, code, tuple(shapes[serial]), places[serial])
            for size, code, serial in zip(sizes, codes, serials)]

    def runs(low: int, high: int) -> list:
        out: list = []
        for i in range(low, high):
            if out and keys[out[-1][0]] == keys[i]:
                out[-1][1] += 1
            else:
                out.append([i, 1, homes[i]])
        return out

    form = _Form(timeline, [], {})
    position = 0
    for kind, begin, end, tiles in loops:
        chunks = [chunk for _, chunk in tiles]
        if begin < position or form.chunks.setdefault(kind, chunks) != chunks:
            return None
        _glue(form, runs, position, begin)
        starts = [start for start, _ in tiles] + [end]
        spans = list(zip(starts, starts[1:]))
        # the middle tiles alike, but for the place in its tile of what a free frees: the first
        # tile is not a middle one
        middles = {tuple(key[:3] + (key[3][0],) for key in keys[low:high])
                   for low, high in spans[1:-1]}
        if len(middles) != 1:
            return None
        form.parts.append(("loop", kind, [runs(*spans[0]), runs(*spans[1]), runs(*spans[-1])]))
        position = end
    _glue(form, runs, position, len(sizes))
    return form if any(part[0] == "backward" for part in form.parts) else None


def _glue(form: _Form, runs, low: int, high: int) -> None:
    backward = form.timeline["backward"]
    if low <= backward <= high and not any(part[0] == "backward" for part in form.parts):
        form.parts += [("glue", runs(low, backward)), ("backward",), ("glue", runs(backward, high))]
    else:
        form.parts.append(("glue", runs(low, high)))


def _structure(form: _Form) -> list:
    """What must match between lengths: the parts, and each run's sign, region, rank, element size
    and allocating loop (not its count or dimensions)."""
    def run(r: list) -> tuple:
        shape, timeline = form.shape(r[0]), form.timeline
        return timeline["sizes"][r[0]] >= 0, timeline["regions"][r[0]], len(shape), shape[0], r[2]

    out: list = []
    for part in form.parts:
        if part[0] == "glue":
            out.append(("glue", [run(r) for r in part[1]]))
        elif part[0] == "loop":
            out.append(("loop", part[1], [[run(r) for r in runs] for runs in part[2]]))
        else:
            out.append(part)
    return out


# ------------------------------------------------------------------ the timeline at another length
class Interpolation:
    """A unit's timelines at the three `basis_lengths`, fitted once: `at(length)` is its timeline
    at a longer length, or None (see the module's docstring)."""

    def __init__(self, timelines: list[dict], lengths: tuple, rules: TileRules, batch: int):
        self.lengths, self.rules, self.batch = tuple(lengths), rules, batch
        self.flops = [t["flops"] for t in timelines]
        self.seen = [q for q in (_quantities(rules, batch, s) for s in lengths) if q is not None]
        self.fits: list[tuple] = []    # each distinct explanation list (`_explain`), by its index
        self._index: dict[tuple, int] = {}
        self._vectors_of: dict[str, dict[str, tuple]] = {}
        self.parts = self._fit(timelines) if len(self.seen) == 3 else None

    def _fit(self, timelines: list[dict]) -> list | None:
        forms = [f for f in (canonical(t) for t in timelines) if f is not None]
        if len(forms) != 3 or any(_structure(f) != _structure(forms[0]) for f in forms[1:]):
            return None
        for form, s in zip(forms, self.lengths):   # the tiling rules hold at every traced length
            expected = self.rules.chunks(self.batch, s)
            if any(chunks != expected.get(kind) for kind, chunks in form.chunks.items()):
                return None
        parts: list = []
        for aligned in zip(*(f.parts for f in forms)):
            tag = aligned[0][0]
            if tag == "backward":
                parts.append(aligned[0])
            elif tag == "glue":
                parts.append(("glue", self._slots(forms, [p[1] for p in aligned], "")))
            else:
                kind = aligned[0][1]
                tiles = [self._slots(forms, [p[2][k] for p in aligned], kind) for k in range(3)]
                parts.append(("loop", kind, tiles))
        if any(slot is None for part in parts if part[0] != "backward"
               for slots in ([part[1]] if part[0] == "glue" else part[2]) for slot in slots):
            return None
        return parts

    def _slots(self, forms: list[_Form], runs: list[list], kind: str) -> list:
        """Each run fitted: (region code, signed element size, [(fit, quantities' kind)] of its
        dimensions, (fit, kind) of its count), None for a run that cannot be; a fit: an index into
        `fits`."""
        out: list = []
        for slot in zip(*runs):
            shapes = [form.shape(run[0]) for form, run in zip(forms, slot)]
            home = slot[0][2].partition(":")[0]   # the kind of loop its storage was made in
            dims = [self._intern(_explain([shape[d] for shape in shapes], self._vectors(home)),
                                 home) for d in range(1, len(shapes[0]))]
            count = self._intern(_explain([run[1] for run in slot], self._vectors(kind)), kind)
            first = slot[0][0]
            sign = 1 if forms[0].timeline["sizes"][first] >= 0 else -1
            if count is None or any(dim is None for dim in dims):
                out.append(None)
            else:
                out.append((forms[0].timeline["regions"][first], sign * shapes[0][0], dims, count))
        return out

    def _intern(self, explanations: list | None, kind: str) -> tuple[int, str] | None:
        if explanations is None:
            return None
        key = tuple(explanations)
        if key not in self._index:
            self._index[key] = len(self.fits)
            self.fits.append(key)
        return self._index[key], kind

    def _vectors(self, kind: str) -> dict[str, tuple]:
        if kind not in self._vectors_of:
            names = self.seen[0][kind]
            self._vectors_of[kind] = {name: tuple(q[kind][name] for q in self.seen)
                                      for name in names}
        return self._vectors_of[kind]

    def at(self, length: int, *, compact: bool = False) -> dict | None:
        """The timeline at `length` (a multiple of LENGTH_QUANTUM past the traced lengths), or None.
        `compact`: each loop's middle tiles past the first and before the last as a few events that
        move the live bytes as they do (`_lumps`): the same `step.summarize`, at any length in
        the time of a short one."""
        target = _quantities(self.rules, self.batch, length)
        if self.parts is None or target is None or length % LENGTH_QUANTUM \
                or length <= max(self.lengths):
            return None
        out = _Timeline(self.fits, target)
        for part in self.parts:
            if part[0] == "backward":
                out.backward = len(out.sizes)
            elif part[0] == "glue":
                out.emit(part[1])
            else:
                kind = part[1]
                first, middle, last = part[2]
                out.emit(first)
                out.emit_middles(middle, target[kind]["T"] - 2, compact)
                out.emit(last)
            if out.failed:
                return None
        return {"sizes": out.sizes, "regions": "".join(out.codes), "backward": out.backward,
                "flops": _quadratic(self.lengths, self.flops, length)}


class _Timeline:
    """The events at the target as they are built; `failed` once a dimension or a count has no
    value there."""

    def __init__(self, fits: list[tuple], target: dict):
        self.fits, self.target = fits, target
        self.values: dict[tuple[int, str], int | None] = {}
        self.sizes: list[int] = []
        self.codes: list[str] = []
        self.backward = 0
        self.failed = False

    def value(self, fit: tuple[int, str]) -> int | None:
        if fit not in self.values:
            self.values[fit] = _value(self.fits[fit[0]], self.target[fit[1]])
        return self.values[fit]

    def emit(self, slots: list) -> None:
        for code, size, dims, count_fit in slots:
            count = self.value(count_fit)
            for fit in dims:
                dim = self.value(fit)
                if dim is None or count is None:
                    self.failed = True
                    return
                size *= dim
            if count is None:
                self.failed = True
                return
            self.sizes += [size] * count
            self.codes += [code] * count

    def emit_middles(self, slots: list, count: int, compact: bool) -> None:
        """`count` middle tiles; `compact`: the first, all but the last as `_lumps`, the last."""
        mark = len(self.sizes)
        self.emit(slots)
        block = (self.sizes[mark:], self.codes[mark:])
        if compact and count > 2:
            sizes, codes = _lumps(*block, count - 2)
            self.sizes += sizes + block[0]
            self.codes += codes + block[1]
        else:
            self.sizes += block[0] * (count - 1)
            self.codes += block[1] * (count - 1)


def _lumps(sizes: list[int], codes: list[str], repeats: int) -> tuple[list[int], list[str]]:
    """Events that change the live bytes of each region (and the gradients landed) as `repeats`
    copies of a block do, frees first: a block's peak is highest in its first copy or in its last
    (the bytes a copy leaves add up linearly), both kept, and the copies reach whatever the lumps
    pass through."""
    net: dict[str, int] = {}
    for size, code in zip(sizes, codes):
        rounded = -(-abs(size) // ALLOCATOR_ROUND) * ALLOCATOR_ROUND
        net[code] = net.get(code, 0) + (rounded if size >= 0 else -rounded)
    # per region code: its allocations less its frees, and (upper case) the gradients that land in
    # it: one free in `summarize`'s first count, bytes moved to the gradients in its second
    events = sorted(((total * repeats, code) for code, total in net.items() if total),
                    key=lambda event: event[0] >= 0)
    return [size for size, _ in events], [code for _, code in events]


def _explain(values: list[int], vectors: dict[str, tuple]) -> list | None:
    """The explanations of a value seen at three lengths, each (name, numerator, denominator, v,
    x): v + numerator / denominator x (quantity - x), checked at the third length; name None: the
    constant v; numerator None: v only where the quantity is x (constant over the three). None when
    nothing explains it, or when a quantity of two values could (a fit with no point to check)."""
    out: list = []
    constant = values[0] == values[1] == values[2]
    if constant:
        out.append((None, 0, 1, values[0], 0))
    for name, xs in vectors.items():
        distinct = len(set(xs))
        if distinct == 3:
            rise, run = values[2] - values[0], xs[2] - xs[0]
            if (values[1] - values[0]) * run == rise * (xs[1] - xs[0]):
                common = math.gcd(rise, run) * (1 if run > 0 else -1)
                out.append((name, rise // common, run // common, values[0], xs[0]))
        elif constant:
            if distinct == 1:
                out.append((name, None, 1, values[0], xs[0]))
        elif len(set(zip(xs, values))) == distinct:
            return None
    return out or None


def _value(explanations: tuple, quantities: dict[str, int]) -> int | None:
    """The value at the target: every explanation must give the same whole number >= 0."""
    answers: set[int | None] = set()
    for name, numerator, denominator, value, x in explanations:
        if name is None:
            answers.add(value)
        elif numerator is None:
            answers.add(value if quantities[name] == x else None)
        else:
            step, rest = divmod(numerator * (quantities[name] - x), denominator)
            answers.add(value + step if rest == 0 and value + step >= 0 else None)
    return answers.pop() if len(answers) == 1 else None


def interpolate(timelines: list[dict], lengths: tuple, length: int, rules: TileRules,
                batch: int) -> dict | None:
    """The timeline at `length` from those traced at the three `lengths` (`basis_lengths`), or
    None: then `length` is traced. (`Interpolation` fits once for many lengths.)"""
    return Interpolation(timelines, lengths, rules, batch).at(length)


def _quadratic(xs: tuple, ys: list[float], x: int) -> float:
    """The quadratic through (xs, ys) at x (Lagrange, in exact fractions)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = Fraction(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return float(total)
