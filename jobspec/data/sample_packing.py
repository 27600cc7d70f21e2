"""`data.packing`: several causal-LM samples in one `max_length` sequence, kept apart by position
ids.

`pack_dataset` turns a dataset of samples (dicts of 1-D LongTensors `input_ids`, `attention_mask`,
`labels`, padded or not) into packed rows:

- the samples' real tokens (attention mask 1) are placed into rows of at most `max_length` tokens by
  first-fit decreasing bin packing (longest first, ties in a seeded order; deterministic for a
  seed);
- `position_ids` restart at 0 with each sample;
- each sample's first label is -100: the model predicts token t+1 from token t, so the label of a
  sample's first token is what the previous sample's last token would be trained to predict, across
  the boundary (in a sample of its own nothing precedes it, so nothing is lost);
- no padding inside a row; `pad_to` (`data.padding: max_length`) pads every row at its end to
  `max_length` (ids with the pad id, `attention_mask` 0, labels -100, position ids 0), else the
  collator pads a batch to its longest row the same way.

A row keeps its `attention_mask` (1 on every real token), so the worker's token count
(jobspec.train.metrics.count_tokens: the mask's sum) counts non-padding tokens, packed or not.

What keeps the samples apart is the model (transformers 5, masking_utils): when the model's forward
gets `position_ids` and no 2-D attention mask and no KV cache, `find_packed_sequence_indices` finds
the samples from the restarts and the causal mask of sdpa, eager and flex attention is cut at their
boundaries; flash_attention_2 takes the varlen kernel from the same position ids, but only for a
batch of one row (`_is_packed_sequence`). `prepare_model` registers a forward pre-hook that makes a
packed batch look like that: it drops `attention_mask` (pad tokens sit at a row's end, so causal
attention keeps them out of every real token's context, and their labels are -100), sets
`use_cache=False` (a model in training mode builds a cache from `config.use_cache`, and a cache
turns the detection off), and for flash attention flattens the micro-batch into one row (each row
starts with a sample whose first label is -100, so the loss is the same token mean). Batches without
`position_ids` (evaluation, which is not packed) pass untouched. The model families whose forward
honours this are `jobspec.techniques.packing.PACKED_FAMILIES`; validation refuses the others.
"""
from __future__ import annotations

import random

import torch

from jobspec.data.loaders import TensorDictDataset
from jobspec.errors import spec_error
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import IGNORE_INDEX
from jobspec.techniques import packing as packing_rules


def pack_order(lengths: list[int], max_length: int, seed: int) -> list[list[int]]:
    """Bins of sample indices: first-fit decreasing over `lengths`, each bin's total at most
    `max_length` (a longer sample gets a bin of its own). Ties between equal lengths are broken in
    an order drawn from `seed`, so the bins are deterministic for a seed and mix the file's
    order."""
    tiebreak = list(range(len(lengths)))
    random.Random(seed).shuffle(tiebreak)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], tiebreak[i]))
    tree = _FirstFit(len(lengths), max_length)
    bins: list[list[int]] = []
    for index in order:
        length = lengths[index]
        slot = tree.first_with(length) if length <= max_length else None
        if slot is None or slot >= len(bins):
            slot = len(bins)
            bins.append([])
        bins[slot].append(index)
        tree.take(slot, min(length, max_length))
    return bins


class _FirstFit:
    """The bins' free space in a max segment tree: the leftmost bin with room for `length`, O(log
    n). Bins not opened yet have all `capacity` free, so the leftmost fitting slot is either an open
    bin or the next new one."""

    def __init__(self, slots: int, capacity: int):
        self.size = 1
        while self.size < max(slots, 1):
            self.size *= 2
        self.free = [capacity] * (2 * self.size)

    def first_with(self, length: int) -> int | None:
        if self.free[1] < length:
            return None
        node = 1
        while node < self.size:
            node = 2 * node if self.free[2 * node] >= length else 2 * node + 1
        return node - self.size

    def take(self, slot: int, length: int) -> None:
        node = slot + self.size
        self.free[node] -= length
        node //= 2
        while node:
            self.free[node] = max(self.free[2 * node], self.free[2 * node + 1])
            node //= 2


def real_tokens(sample: dict) -> dict:
    """A sample's `input_ids` and `labels` without its padding (the attention mask's zeros)."""
    ids, labels = sample["input_ids"], sample["labels"]
    mask = sample.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        keep = mask.bool()
        ids, labels = ids[keep], labels[keep]
    return {"input_ids": ids, "labels": labels}


def pack_rows(samples: list[dict]) -> dict:
    """One packed row from unpadded samples: ids and labels joined, each sample's first label -100,
    position ids restarting at 0 per sample, attention mask all ones."""
    labels = []
    for sample in samples:
        first_masked = sample["labels"].clone()
        if len(first_masked):
            first_masked[0] = IGNORE_INDEX
        labels.append(first_masked)
    ids = torch.cat([s["input_ids"] for s in samples])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.cat(labels),
        "position_ids": torch.cat([torch.arange(len(s["input_ids"]), dtype=torch.long)
                                   for s in samples]),
    }


def pad_row(row: dict, length: int, pad_token_id: int) -> dict:
    """`row` padded at its end to `length`: ids with the pad id, mask 0, labels -100, position ids
    0."""
    extra = length - len(row["input_ids"])
    if extra <= 0:
        return row
    values = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX,
              "position_ids": 0}
    return {name: torch.cat([tensor, torch.full((extra,), values[name], dtype=tensor.dtype)])
            for name, tensor in row.items()}


def pack_dataset(dataset, max_length: int, seed: int,
                 pad_to: int | None = None) -> "PackedDataset | LazyPackedDataset":
    """The packed rows of `dataset` (see the module's docstring), keeping its `pad_token_id` and
    `label_names`. `pad_to`: pad every row to that length (fixed shapes). A dataset that knows its
    samples' lengths (the data cache's, data/loaders.CachedDataset) is packed from them: the rows
    are joined when they are read, so a rank holds no copy of the data."""
    pad_token_id = getattr(dataset, "pad_token_id", 0) or 0
    label_names = getattr(dataset, "label_names", None)
    if hasattr(dataset, "lengths"):
        lengths = [int(n) for n in dataset.lengths()]
        kept = [i for i, n in enumerate(lengths) if n]   # an empty sample has nothing to train on
        bins = [[kept[i] for i in members]
                for members in pack_order([lengths[i] for i in kept], max_length, seed)]
        stats = PackingStats(samples=len(kept), rows=len(bins), tokens=sum(lengths),
                             max_length=max_length)
        return LazyPackedDataset(dataset, bins, stats, pad_to, pad_token_id, label_names)
    samples = [real_tokens(dataset[i]) for i in range(len(dataset))]
    samples = [s for s in samples if len(s["input_ids"])]
    bins = pack_order([len(s["input_ids"]) for s in samples], max_length, seed)
    rows = [pack_rows([samples[i] for i in members]) for members in bins]
    if pad_to:
        rows = [pad_row(row, pad_to, pad_token_id) for row in rows]
    names = ("input_ids", "attention_mask", "labels", "position_ids")
    columns: dict = {name: [row[name] for row in rows] for name in names}
    if pad_to:
        columns = {name: torch.stack(values) for name, values in columns.items()}
    stats = PackingStats(samples=len(samples), rows=len(rows),
                         tokens=sum(len(s["input_ids"]) for s in samples), max_length=max_length)
    return PackedDataset(columns, stats, pad_token_id=pad_token_id, label_names=label_names)


class PackingStats:
    """How full the packed rows are: samples, rows, real tokens, and the fill against
    `max_length`."""

    def __init__(self, samples: int, rows: int, tokens: int, max_length: int):
        self.samples, self.rows, self.tokens, self.max_length = samples, rows, tokens, max_length

    @property
    def fill(self) -> float:
        return self.tokens / (self.rows * self.max_length) if self.rows else 0.0

    def note(self) -> str:
        return (f"packing: {self.samples} samples in {self.rows} rows of at most {self.max_length} "
                f"tokens ({self.fill:.1%} full)")


class PackedDataset(TensorDictDataset):
    """Packed rows (`input_ids`, `attention_mask`, `labels`, `position_ids`) and how full they
    are."""

    def __init__(self, columns: dict, packing: PackingStats, pad_token_id: int = 0,
                 label_names: dict | None = None):
        super().__init__(columns, pad_token_id=pad_token_id, label_names=label_names)
        self.packing = packing


class LazyPackedDataset(torch.utils.data.Dataset):
    """Packed rows joined from `dataset`'s samples when they are read (the bins are decided up
    front)."""

    def __init__(self, dataset, bins: list, packing: "PackingStats", pad_to: int | None,
                 pad_token_id: int, label_names: dict | None):
        self.dataset, self.bins, self.packing, self.pad_to = dataset, bins, packing, pad_to
        self.pad_token_id, self.label_names = pad_token_id, label_names

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict:
        row = pack_rows([real_tokens(self.dataset[i]) for i in self.bins[index]])
        return pad_row(row, self.pad_to, self.pad_token_id) if self.pad_to else row


def pack_datasets(spec: JobSpec, train, evaluation):
    """(train, eval) with the training set packed when `data.packing` is on. Evaluation stays
    unpacked: its loss and metrics are then the same numbers with packing on or off."""
    data = spec["data"]
    if not data.get("packing") or train is None:
        return train, evaluation
    pad_to = data["max_length"] if data["padding"] == "max_length" else None
    return pack_dataset(train, data["max_length"], spec["training"]["seed"],
                        pad_to=pad_to), evaluation


def prepare_model(model, spec: JobSpec) -> str | None:
    """With `data.packing`: refuse a model whose forward does not keep packed samples apart (a hub
    id validation could not look into), and register the forward pre-hook that hands it packed
    batches (see the module's docstring). Returns a note for the run's notes, or None without
    packing."""
    if not spec["data"].get("packing"):
        return None
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    attention = getattr(config, "_attn_implementation", None) or spec["model"]["attention"]
    problem = packing_rules.model_problem(model_type, attention)
    if problem is not None:
        raise spec_error(problem[0], path=("data", "packing"), hint=problem[1])
    flatten = str(attention).startswith("flash_attention")
    model.register_forward_pre_hook(packed_forward_hook(flatten), with_kwargs=True)
    flattened = ", micro-batch flattened to one row" if flatten else ""
    return f"packing: position ids restart per sample ({attention}{flattened})"


def packed_forward_hook(flatten: bool):
    """The forward pre-hook of a packing model: see the module's docstring."""

    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is None:
            return None
        kwargs.pop("attention_mask", None)
        kwargs["use_cache"] = False
        if flatten:
            for name in ("input_ids", "position_ids", "labels"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name].reshape(1, -1)
        return args, kwargs

    return hook
