"""Records as a `datasets.Dataset`: a local jsonl/csv/parquet file, a dataset by name, a saved
dataset.

- a file: `datasets.load_dataset(<builder>, data_files=...)`; a row it cannot read is named by file
  and line (jobspec.data.record_checks scans the file for it);
- `hf:org/name`: `datasets.load_dataset(name, data.subset, split=data.train_split /
  data.eval_split)`, through the Hugging Face cache; offline (HF_DATASETS_OFFLINE=1 or
  HF_HUB_OFFLINE=1) it reads the cache only, as datasets does. `hf:` followed by a local directory
  (relative to the spec file) loads that directory: a `save_to_disk` one with `load_from_disk`, else
  as a dataset repository;
- a local `save_to_disk` directory given as a path: `datasets.load_from_disk` (a DatasetDict: the
  split `train_split` / `eval_split` names).
"""
from __future__ import annotations

from pathlib import Path

from jobspec.data import record_checks
from jobspec.data.formats import HF_PREFIX, is_saved_dataset, split_source
from jobspec.errors import first_line, spec_error
from jobspec.spec.types import JobSpec

# data.format -> datasets.load_dataset's
DATASETS_BUILDER = {"jsonl": "json", "csv": "csv", "parquet": "parquet"}


def load_table(spec: JobSpec, split: str, kind: str):
    """`data.<split>` as a datasets.Dataset; `kind` is record_checks' source kind (a file format,
    hub, saved)."""
    data = spec["data"]
    source = split_source(data, split)
    if kind == "hub":
        return _by_name(spec, split, source[len(HF_PREFIX):])
    if kind == "saved":
        return _saved(spec, split, source)
    return _file(spec, split, source, kind)


def split_name(spec: JobSpec, split: str) -> str:
    return spec["data"]["train_split" if split == "train" else "eval_split"]


def _file(spec: JobSpec, split: str, path: str, fmt: str):
    import datasets

    if not Path(path).is_file():
        raise spec_error(f"{split} file not found: {path}", path=("data", split),
                         hint="check the path")
    try:
        return datasets.load_dataset(DATASETS_BUILDER[fmt], data_files=str(path), split="train")
    except Exception as err:  # datasets raises many types for unreadable files
        raise record_checks.locate_error(spec, split) \
            or record_checks.unreadable(spec, split, fmt, err) from None


def _saved(spec: JobSpec, split: str, path: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as err:  # a damaged directory: FileNotFoundError, ValueError, pyarrow errors
        raise spec_error(f"cannot load the saved dataset {path}: {first_line(err)}",
                         path=("data", split),
                         hint="point it at a directory written by datasets' save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        return _pick(loaded, spec, split, path)
    return loaded


def _by_name(spec: JobSpec, split: str, name: str):
    import datasets

    local = Path(name).expanduser()
    if local.is_absolute() and is_saved_dataset(local):
        return _saved(spec, split, str(local))
    data = spec["data"]
    wanted = split_name(spec, split)
    try:
        return datasets.load_dataset(name, data.get("subset"), split=wanted)
    except Exception as err:   # not found, offline with nothing cached, no such subset or split
        text = first_line(err)
        hint = ("check the name, data.subset and data.train_split / data.eval_split; offline "
                "(HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1) only what the Hugging Face cache holds "
                "loads")
        if "split" in text.lower() or "config" in text.lower():
            field = ("data", "train_split" if split == "train"
                     else "eval_split") if "split" in text.lower() \
                else ("data", "subset")
            raise spec_error(f"{HF_PREFIX}{name}: {text}", path=field, hint=hint) from None
        raise spec_error(f"cannot load the dataset {HF_PREFIX}{name}: {text}", path=("data", split),
                         hint=hint) from None


def _pick(loaded, spec: JobSpec, split: str, source: str):
    wanted = split_name(spec, split)
    if wanted not in loaded:
        field = "train_split" if split == "train" else "eval_split"
        raise spec_error(f"{source} has no split {wanted!r} (splits: {', '.join(loaded)})",
                         path=("data", field), hint=f"set data.{field} to one of its splits")
    return loaded[wanted]
