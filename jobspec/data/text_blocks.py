"""Text data (`data.format: text`, .txt/.md files, a directory of them) cut into language-model
blocks.

A document (data/formats/text.py: a line of the file, `data.document: line`, blank lines skipped;
the whole file, `document: file`; or each file of a directory) is tokenized with the tokenizer's own
special tokens (a BOS where the tokenizer adds one, BERT's [CLS] ... [SEP]) and ends with its EOS
(SEP for a tokenizer without one) unless it already does. Then, so that no token is thrown away:

- `chunking: concatenate`: all documents joined and cut into blocks of `max_length` (only the last
  block is shorter);
- `chunking: per_document`: each document cut into pieces of at most `max_length`, none spanning two
  documents.

Causal LM trains on every token (labels = ids); masked LM masks the same blocks (data/loaders.py).
"""
from __future__ import annotations

import warnings

import torch

from jobspec.data.formats import split_format, split_source
from jobspec.errors import spec_error
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import MASKED_TOKENS, NEXT_TOKENS


def document_ids(tokenizer, documents: list[str]) -> list[list[int]]:
    """Each document's token ids with the tokenizer's special tokens, ending with EOS (or SEP)."""
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    # verbose=False: a document longer than the model's positions is expected here (it is cut into
    # blocks)
    encoded = tokenizer(documents, add_special_tokens=True, verbose=False)["input_ids"]
    if end is None:
        warnings.warn("the tokenizer has neither an EOS nor a SEP token: text documents are joined "
                      "without a separator", stacklevel=2)
        return [list(ids) for ids in encoded]
    return [list(ids) if ids and ids[-1] == end else [*ids, end] for ids in encoded]


def blocks(documents: list[list[int]], max_length: int, chunking: str) -> list[list[int]]:
    """Token blocks of at most `max_length`: the documents joined then cut, or each one cut."""
    if chunking == "concatenate":
        joined = [token for ids in documents for token in ids]
        return [joined[i:i + max_length] for i in range(0, len(joined), max_length)]
    return [ids[i:i + max_length] for ids in documents for i in range(0, len(ids), max_length)]


def text_columns(spec: JobSpec, tokenizer, split: str, shape: str) -> tuple[list, list]:
    """(input ids, attention masks) of `data.<split>`'s text as 1-D LongTensors, unpadded."""
    data = spec["data"]
    if shape not in (NEXT_TOKENS, MASKED_TOKENS):
        raise spec_error(f"text files have no labels; {spec['model']['task']} needs records with "
                         f"{data['label_field']!r}", path=("data", split),
                         hint="use a jsonl/csv/parquet file with text and label columns, or a "
                              "language-model task")
    documents = split_format(data, split).documents(split_source(data, split), data["format"],
                                                    data["document"], split)
    if not documents:
        raise spec_error(f"{split_source(data, split)} has no text", path=("data", split),
                         hint="a text file needs at least one non-blank line")
    cut = blocks(document_ids(tokenizer, documents), data["max_length"], data["chunking"])
    ids = [torch.tensor(block, dtype=torch.long) for block in cut]
    return ids, [torch.ones_like(block) for block in ids]
