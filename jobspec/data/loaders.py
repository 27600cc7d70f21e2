"""Training and evaluation data: records (jsonl/csv/parquet files, `hf:` datasets, saved datasets:
their format's `dataset`, data/formats/; text records tokenised by their kind,
data/records/text.py), text corpora (data/text_blocks.py), chat and prompt/completion records
(tokenised once into the data cache by data/prepare.py, memory-mapped here: `CachedDataset`), or
synthetic tokens.

Every dataset is map-style and yields dicts of LongTensors `input_ids`, `attention_mask`, `labels`:
- sequence-classification: `labels` is the class id (a 0-d tensor, stacked to (batch,));
- token-classification: one label per token, -100 on special tokens, padding and non-first
  sub-words;
- masked-lm: 15% of the tokens chosen (BERT's 80/10/10 mask/random/keep), -100 elsewhere, fixed per
  seed;
- causal-lm: `labels` are the input ids (the model shifts them), -100 on padding; chat and
  prompt/completion records: -100 also outside the answers (`data.loss_on: answers`).
With `padding: max_length` samples are padded to `max_length`; with `longest` they are unpadded 1-D
tensors, padded per batch by `PadCollator`.
`make_loader` shards a dataset over ranks deterministically, takes whole global batches per training
epoch, evaluates every eval sample exactly once, and can resume mid-epoch.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from jobspec import tasks
from jobspec.data import prepare as data_prep
from jobspec.data import record_checks, text_blocks
from jobspec.data.formats import split_format, split_source
from jobspec.data.records import Columns
from jobspec.errors import SpecError, spec_error
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import CLASS, IGNORE_INDEX, MASKED_TOKENS, NEXT_TOKENS, TOKEN_CLASS

MLM_PROBABILITY = 0.15
# synthetic `learnable` sequence labels: the share of a sample's tokens drawn from its label's slice
# of the vocabulary range (the rest are drawn from the whole range)
LEARNABLE_SIGNAL = 0.5


class TensorDictDataset(Dataset):
    """Rows of named tensors (a 2-D tensor per column, or a list of 1-D tensors of varying
    length)."""

    def __init__(self, columns: dict, pad_token_id: int = 0, label_names: dict | None = None):
        self.columns = columns
        self.pad_token_id = pad_token_id  # used by the collate function for `padding: longest`
        # string labels -> ids (file data whose labels are names): the exported config's label2id,
        # and BIO tags for the entity F1 (jobspec.train.task_metrics)
        self.label_names = label_names or None
        self._length = len(next(iter(columns.values())))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict:
        return {name: column[index] for name, column in self.columns.items()}


class CachedDataset(Dataset):
    """A split's tokenised records memory-mapped from the data cache (jobspec/data/cache.py): a
    sample is read from the mapped arrays when it is asked for, so a rank holds only the pages it
    reads."""

    def __init__(self, cached, pad_to: int | None, pad_token_id: int):
        self.cached, self.pad_to, self.pad_token_id = cached, pad_to, pad_token_id
        self.label_names: dict | None = None   # records of a causal-lm have no label names

    def __len__(self) -> int:
        return len(self.cached)

    def lengths(self) -> np.ndarray:
        return self.cached.lengths()

    def __getitem__(self, index: int) -> dict:
        ids, labels = self.cached.sample(int(index))
        sample = {"input_ids": torch.from_numpy(ids.astype(np.int64)),
                  "attention_mask": torch.ones(len(ids), dtype=torch.long),
                  "labels": torch.from_numpy(labels.astype(np.int64))}
        extra = (self.pad_to or 0) - len(ids)
        if extra > 0:
            pads = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
            sample = {name: torch.cat([value, torch.full((extra,), pads[name], dtype=torch.long)])
                      for name, value in sample.items()}
        return sample


class PadCollator:
    """Stacks samples, padding to the longest in the batch (ids with pad, mask with 0, labels with
    -100)."""

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict]) -> dict:
        pad_values = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        batch = {}
        for key in samples[0]:
            values = [s[key] for s in samples]
            shape = values[0].shape
            # fixed length (or 0-d labels): no padding needed
            if all(v.shape == shape for v in values):
                batch[key] = torch.stack(values)
            else:
                batch[key] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True,
                                                             padding_value=pad_values.get(key, 0))
        return batch


def build_datasets(spec: JobSpec, tokenizer):
    """(train, eval or None) for the spec's data section and model task."""
    data = spec["data"]
    if data.get("synthetic") is not None:
        return _synthetic_datasets(spec)
    if not data.get("train"):
        raise spec_error("no training data", path=("data", "train"),
                         hint="set data.train to a data or text file, hf:name, or data.synthetic: "
                              "{}")
    label_names: dict = {}  # string labels -> ids, shared by train and eval
    train = _file_dataset(spec, tokenizer, "train", label_names)
    evaluation = _file_dataset(spec, tokenizer, "eval", label_names) if data.get("eval") else None
    for dataset in (train, evaluation):
        if dataset is not None:
            dataset.label_names = dict(label_names) or None
    return train, evaluation


def data_params(*datasets) -> dict:
    """The tokenised data's counts for MLflow (`data.<split>.records`, `samples`, `tokens`,
    `truncated`, `no_answer`, `cache_mib`) of the datasets read from the data cache (a packed one
    through its samples)."""
    params: dict = {}
    for dataset in datasets:
        # sample_packing.LazyPackedDataset: its samples
        dataset = getattr(dataset, "dataset", dataset)
        if isinstance(dataset, CachedDataset):
            params.update(data_prep.data_counts(dataset.cached))
    return params


def make_loader(dataset, *, micro_batch_size: int, rank: int, world_size: int, seed: int,
                epoch: int,
                shuffle: bool, num_workers: int, pin_memory: bool, skip_batches: int = 0,
                global_batch_size: int | None = None) -> DataLoader:
    """A DataLoader over this rank's shard of `dataset` for one epoch.

    The order depends only on (seed, epoch), so every rank agrees on it. Training passes the global
    batch: an epoch is then the first `epoch_samples(len(dataset), global_batch_size)` samples of
    that order, whatever the split -- which samples train must not depend on the micro-batch, the
    ranks or the accumulation (docs/loss.md). Sample i of the epoch goes to rank i % world_size, and
    a rank's micro-batches are consecutive runs of its share, so optimizer step k trains samples
    [k G, (k + 1) G) of the order on any split. Evaluation passes none: then every sample is
    evaluated exactly once (`_EvalBatches`: a rank's last batch may be short, and a rank with fewer
    batches ends with a padding batch whose labels are all ignored, so every rank runs the same
    number of forward passes -- ZeRO-3's forward gathers parameters collectively).
    `skip_batches` starts the epoch that many batches in (resuming at the exact data position).
    """
    collate = PadCollator(getattr(dataset, "pad_token_id", 0) or 0)
    pin_memory = pin_memory and torch.cuda.is_available()
    if global_batch_size is None:
        batches = _EvalBatches(_order(len(dataset), shuffle, seed, epoch),
                               micro_batch_size=micro_batch_size,
                               rank=rank, world_size=world_size, skip=skip_batches)
        return DataLoader(_WithPadding(dataset), batch_sampler=batches, num_workers=num_workers,
                          pin_memory=pin_memory, collate_fn=collate)
    samples = epoch_samples(len(dataset), global_batch_size)
    sampler = _ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                seed=seed,
                                drop_last=True, skip=skip_batches * micro_batch_size,
                                epoch_samples=samples)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=True,
                      num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate)


def epoch_samples(num_samples: int, global_batch_size: int) -> int:
    """The samples one training epoch uses: whole global batches (the same count for every split;
    jobspec.spec.derived counts an epoch's steps from it)."""
    return num_samples // global_batch_size * global_batch_size


class _ResumableSampler(DistributedSampler):
    """DistributedSampler that can start `skip` samples into its shard, over the first
    `epoch_samples` samples of the epoch's order (DistributedSampler's drop_last keeps `total_size`
    of them and deals them out rank by rank; a multiple of world_size keeps that exact)."""

    def __init__(self, *args, skip: int = 0, epoch_samples: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = skip
        if epoch_samples is not None:
            assert epoch_samples % self.num_replicas == 0, (epoch_samples, self.num_replicas)
            self.total_size, self.num_samples = epoch_samples, epoch_samples // self.num_replicas

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


PADDING_INDEX = -1   # an eval batch sampler's stand-in for "a sample whose labels count nothing"


def _order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's sample order: DistributedSampler's (a permutation seeded by seed + epoch)."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


class _EvalBatches:
    """An eval batch sampler: rank r takes samples r, r + W, ... of `order` (each sample on exactly
    one rank, none repeated: DistributedSampler would repeat some to even the shares out), in
    micro-batches, the last one short. Ranks whose share fills fewer batches than rank 0's (at most
    one fewer) end with one batch of `PADDING_INDEX`, which `_WithPadding` turns into a sample whose
    labels are all ignored: a forward pass that adds nothing to the loss sums, the labelled-token
    counts or the task metrics' counts (jobspec.train.token_loss, jobspec.train.task_metrics)."""

    def __init__(self, order: list[int], *, micro_batch_size: int, rank: int, world_size: int,
                 skip: int = 0):
        share = order[rank::world_size]
        batches = [share[i:i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
        most = -(-len(order[::world_size]) // micro_batch_size)   # rank 0's share is the largest
        self.batches = (batches + [[PADDING_INDEX]] * (most - len(batches)))[skip:]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _WithPadding(Dataset):
    """`dataset`, and at `PADDING_INDEX` its first sample with every label ignored (-100: a token
    task's labels, and a sequence classification's one label, which jobspec.train.token_loss then
    counts as no sample) -- real inputs, so the padding batch's forward runs what any batch runs."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        if index != PADDING_INDEX:
            return self.dataset[index]
        sample = dict(self.dataset[0])
        sample["labels"] = torch.full_like(torch.as_tensor(sample["labels"]), IGNORE_INDEX)
        return sample


# ---- synthetic data ---------------------------------------------------------------------------

def _synthetic_datasets(spec: JobSpec):
    synthetic = spec["data"]["synthetic"]
    assert synthetic is not None, "synthetic data needs data.synthetic"
    seed = spec["training"]["seed"]
    train = synthetic_dataset(spec, synthetic["num_samples"], seed)
    eval_samples = synthetic["eval_samples"]
    # a different seed stream, so the eval samples are not a copy of the first training samples
    evaluation = synthetic_dataset(spec, eval_samples, seed + 1_000_003) if eval_samples else None
    return train, evaluation


def synthetic_dataset(spec: JobSpec, num_samples: int, seed: int) -> TensorDictDataset:
    """Random token ids in `vocab_range`; `labels: learnable` derives the labels from the tokens."""
    synthetic = spec["data"]["synthetic"]
    assert synthetic is not None, "synthetic data needs data.synthetic"
    shape = tasks.of(spec).labels   # the task's label shape (jobspec/tasks)
    num_labels = spec["model"]["num_labels"]
    low, high = synthetic["vocab_range"]
    if high <= low:
        raise spec_error(f"vocab_range [{low}, {high}) is empty",
                         path=("data", "synthetic", "vocab_range"),
                         hint="the second id must be larger than the first")
    seq_len, learnable = synthetic["seq_len"], synthetic["labels"] == "learnable"
    generator = torch.Generator().manual_seed(seed)
    if learnable and shape in (MASKED_TOKENS, NEXT_TOKENS):
        # counting sequences (start, start+1, ...) wrapped in the range: the next token is
        # predictable
        start = torch.randint(low, high, (num_samples, 1), generator=generator)
        ids = low + (start - low + torch.arange(seq_len)) % (high - low)
    else:
        ids = torch.randint(low, high, (num_samples, seq_len), generator=generator)
    if learnable and shape == CLASS:
        # a "topic" per sample: the label is uniform (chance loss ln(num_labels)) and each token
        # comes from the label's slice of the range with probability LEARNABLE_SIGNAL: every token
        # is evidence, so even a tiny model learns it within tens of steps
        labels = torch.randint(0, num_labels, (num_samples,), generator=generator)[:, None]
        size = high - low   # slice c: the ids with (id - low) * num_labels // size == c
        start = (labels * size + num_labels - 1) // num_labels
        end = ((labels + 1) * size + num_labels - 1) // num_labels
        offset = (torch.rand(ids.shape, generator=generator) * (end - start)).long()
        topical = torch.rand(ids.shape, generator=generator) < LEARNABLE_SIGNAL
        ids = torch.where(topical & (end > start), low + start + offset, ids)
        labels = labels[:, 0]
    mask = torch.ones_like(ids)
    columns = {"input_ids": ids, "attention_mask": mask}
    if shape == CLASS:
        if learnable:
            columns["labels"] = labels
        else:
            columns["labels"] = torch.randint(0, num_labels, (num_samples,), generator=generator)
    elif shape == TOKEN_CLASS:
        if learnable:
            columns["labels"] = (ids - low) * num_labels // (high - low)  # which slice of the range
        else:
            columns["labels"] = torch.randint(0, num_labels, ids.shape, generator=generator)
    elif shape == MASKED_TOKENS:
        # no tokenizer: the id just below the range is the mask token (inside the range when it
        # starts at 0)
        mask_id = low - 1 if low > 0 else high - 1
        columns["input_ids"], columns["labels"] = _mask_tokens(ids, mask,
                                                               torch.zeros_like(ids,
                                                                                dtype=torch.bool),
                                                               mask_id, (low, high), generator)
    else:
        columns["labels"] = ids.clone()
    return TensorDictDataset(columns, pad_token_id=0)


def _mask_tokens(ids, attention_mask, special, mask_id: int, vocab: tuple[int, int], generator):
    """BERT masking: 15% of real tokens are targets; of those 80% -> mask, 10% -> random id, 10%
    kept."""
    draw = torch.rand(ids.shape, generator=generator)
    targets = (draw < MLM_PROBABILITY) & attention_mask.bool() & ~special
    labels = torch.where(targets, ids, torch.full_like(ids, IGNORE_INDEX))
    action = torch.rand(ids.shape, generator=generator)
    masked = ids.clone()
    masked[targets & (action < 0.8)] = mask_id
    randomised = targets & (action >= 0.8) & (action < 0.9)
    masked[randomised] = torch.randint(vocab[0], vocab[1], ids.shape,
                                       generator=generator)[randomised]
    return masked, labels


# ---- file data --------------------------------------------------------------------------------

def _file_dataset(spec: JobSpec, tokenizer, split: str,
                  label_names: dict) -> TensorDictDataset | CachedDataset:
    """The samples of `data.<split>`. A row datasets, pyarrow, the tokenizer or the chat template
    cannot take is named by file and line (jobspec.data.record_checks scans the file for it): exit
    2, not a rank traceback."""
    data, task = spec["data"], spec["model"]["task"]
    if tokenizer is None:
        raise spec_error("file data needs a tokenizer", path=("data", "tokenizer"),
                         hint="set data.tokenizer (or use model.name_or_path)")
    fmt = split_format(data, split)
    shape = tasks.get(task).labels
    if not fmt.holds_records:   # a text corpus: documents cut into blocks
        try:
            ids, mask = text_blocks.text_columns(spec, tokenizer, split, shape)
        except (UnicodeDecodeError, ValueError):
            raise record_checks.locate_error(spec, split) or _unlocated(spec, split) from None
        if shape == MASKED_TOKENS:
            labels, ids = _mask_file_tokens(ids, mask, tokenizer, spec["training"]["seed"], split)
        else:
            labels = [row.clone() for row in ids]
        return _samples(spec, tokenizer, ids, mask, labels)
    if data_prep.cached_kind(spec, split):
        # chat and prompt/completion records: tokenised once into the data cache (by the launcher
        # before the ranks started, else here by one process of this host while the others wait) and
        # mapped; a rank builds in its own process: forking one that holds gloo's threads is not
        # safe
        entry = data_prep.prepare_split(spec, split, tokenizer, num_proc=1)
        assert entry.data is not None
        pad_to = data["max_length"] if data["padding"] == "max_length" else None
        return CachedDataset(entry.data, pad_to, tokenizer.pad_token_id or 0)
    table = record_checks.load_dataset(spec, split)
    columns = Columns.of(spec).resolved(table.column_names)
    kind = columns.kind
    if kind.rendered:   # chat or prompt/completion records of another task than causal-lm
        raise spec_error(f"{kind.described} records train a causal-lm, not a {task}",
                         path=("data", "records"),
                         hint="set model.task: causal-lm, or data.records: text")
    _check_columns(spec, table, split, columns)
    try:
        return _tokenize(spec, tokenizer, table, split, label_names, columns)
    # a row pyarrow or the tokenizer refused
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as err:
        located = record_checks.locate_error(spec, split) if fmt.local else None
        if located is None:
            raise  # every row is well-formed: not the data's fault, keep the traceback
        raise located from err


def _check_columns(spec: JobSpec, table, split: str, columns: Columns) -> None:
    data = spec["data"]
    for column in columns.needed():
        if column not in table.column_names:
            raise spec_error(f"column {column!r} not in {Path(split_source(data, split)).name} "
                             f"(columns: {', '.join(table.column_names)})",
                             path=columns.kind.column_field(columns, column),
                             hint="name one of the data's columns")


def _unlocated(spec: JobSpec, split: str) -> SpecError:
    return spec_error(f"{split_source(spec['data'], split)} is not UTF-8 text",
                      path=("data", split), hint="save it as UTF-8")


def _samples(spec: JobSpec, tokenizer, ids: list, mask: list, labels: list) -> TensorDictDataset:
    """Rows of 1-D tensors, padded to `max_length` and stacked with `padding: max_length`."""
    pad_id = tokenizer.pad_token_id or 0
    columns: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if spec["data"]["padding"] == "max_length":
        length = spec["data"]["max_length"]
        fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        columns = {name: torch.stack([torch.nn.functional.pad(row, (0, length - len(row)),
                                                              value=fill[name])
                                      for row in rows]) if rows
                   else torch.zeros(0, length, dtype=torch.long)
                   for name, rows in columns.items()}
    return TensorDictDataset(columns, pad_token_id=pad_id)


def _tokenize(spec: JobSpec, tokenizer, table, split: str, label_names: dict,
              records: Columns) -> TensorDictDataset:
    data, model = spec["data"], spec["model"]
    task = model["task"]
    fixed = data["padding"] == "max_length"
    encoded = records.kind.encode(records, tokenizer, table, data["max_length"], fixed)
    ids = [torch.tensor(x, dtype=torch.long) for x in encoded["input_ids"]]
    mask = [torch.tensor(x, dtype=torch.long) for x in encoded["attention_mask"]]
    label_field = data["label_field"]
    shape = tasks.get(task).labels
    if shape == CLASS:
        classes = _class_ids(list(table[label_field]), label_names, model["num_labels"], split)
        labels = list(torch.tensor(classes, dtype=torch.long))
    elif shape == TOKEN_CLASS:
        labels = _word_labels(encoded, list(table[label_field]), label_names, model["num_labels"],
                              split)
    elif shape == MASKED_TOKENS:
        labels, ids = _mask_file_tokens(ids, mask, tokenizer, spec["training"]["seed"], split)
    else:
        labels = [torch.where(m.bool(), i, torch.full_like(i, IGNORE_INDEX))
                  for i, m in zip(ids, mask)]
    columns: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if fixed:
        columns = {name: torch.stack(rows) for name, rows in columns.items()}
    return TensorDictDataset(columns, pad_token_id=tokenizer.pad_token_id or 0)


def _class_ids(values: list, label_names: dict, num_labels: int, split: str) -> list[int]:
    """Integer labels as they are; string labels numbered in sorted order of the training file."""
    if values and isinstance(values[0], str):
        if not label_names:
            label_names.update({name: i for i, name in enumerate(sorted(set(values)))})
        unknown = sorted(set(values) - set(label_names))
        if unknown:
            raise spec_error(f"{split} labels {unknown[:5]} do not occur in the training data",
                             path=("data", "label_field"),
                             hint="use the same label names in both files")
        values = [label_names[v] for v in values]
    bad = [v for v in values if not isinstance(v, (int, np.integer)) or not 0 <= v < num_labels]
    if bad:
        raise spec_error(f"{split} label {bad[0]!r} is not a class id in [0, {num_labels})",
                         path=("model", "num_labels"),
                         hint="set model.num_labels to the number of classes")
    return [int(v) for v in values]


def _word_labels(encoded, word_labels: list, label_names: dict, num_labels: int,
                 split: str) -> list:
    """Per-token labels: each word's label on its first sub-word token, -100 elsewhere."""
    flat = _class_ids([label for row in word_labels for label in row], label_names, num_labels,
                      split)
    out, start = [], 0
    for row_index, row in enumerate(word_labels):
        row_ids, start = flat[start:start + len(row)], start + len(row)
        token_labels, previous = [], None
        for word in encoded.word_ids(row_index):
            token_labels.append(IGNORE_INDEX if word is None or word == previous else row_ids[word])
            previous = word
        out.append(torch.tensor(token_labels, dtype=torch.long))
    return out


def _mask_file_tokens(ids: list, mask: list, tokenizer, seed: int, split: str):
    if tokenizer.mask_token_id is None:
        raise spec_error("masked-lm needs a tokenizer with a mask token",
                         path=("data", "tokenizer"),
                         hint="use a tokenizer that defines mask_token (e.g. [MASK] or <mask>)")
    special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)))
    generator = torch.Generator().manual_seed(seed if split == "train" else seed + 1_000_003)
    labels, masked = [], []
    for row_ids, row_mask in zip(ids, mask):
        special = torch.isin(row_ids, special_ids)
        row_masked, row_labels = _mask_tokens(row_ids, row_mask, special, tokenizer.mask_token_id,
                                              (0, len(tokenizer)), generator)
        masked.append(row_masked)
        labels.append(row_labels)
    return labels, masked
