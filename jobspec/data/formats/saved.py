"""A directory written by datasets' `save_to_disk` (a Dataset, or a DatasetDict whose split
`data.train_split` / `data.eval_split` names), given as a path or as `hf:DIR`: read with
`datasets.load_from_disk` by the ranks (and the preparation pass), never by validate."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from jobspec.data.formats.base import DataFormat, split_name, split_source
from jobspec.errors import first_line, spec_error
from jobspec.spec.types import JobSpec

# what save_to_disk leaves in a directory (a Dataset, a DatasetDict)
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


class SavedDataset(DataFormat):
    name = "saved"
    schema_value = False
    local = False
    counted = False

    @property
    def described(self) -> str:
        return "a saved dataset"

    def claims(self, source: str) -> bool:
        return is_saved_dataset(source)

    def where(self, spec: JobSpec, split: str, index: int) -> str:
        return f"{split_source(spec['data'], split)} [{split_name(spec, split)}] row {index + 1}"

    def fingerprint(self, spec: JobSpec, split: str, table: Any) -> dict:
        # datasets' fingerprint of the loaded table: its Arrow files (a dataset by name: in the
        # local cache), or the saved directory's state
        return {"name": split_source(spec["data"], split), "subset": spec["data"].get("subset"),
                "split": split_name(spec, split),
                "fingerprint": getattr(table, "_fingerprint", None), "rows": len(table)}

    def dataset(self, spec: JobSpec, split: str) -> Any:
        return load_saved(spec, split, split_source(spec["data"], split))


def is_saved_dataset(path: str | Path) -> bool:
    """A directory written by datasets' `save_to_disk` (read with `load_from_disk`)."""
    path = Path(path)
    try:
        return path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS)
    except OSError:
        return False


def load_saved(spec: JobSpec, split: str, path: str) -> Any:
    """The saved dataset at `path`: a Dataset, or the DatasetDict's split the spec names."""
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as err:  # a damaged directory: FileNotFoundError, ValueError, pyarrow errors
        raise spec_error(f"cannot load the saved dataset {path}: {first_line(err)}",
                         path=("data", split),
                         hint="point it at a directory written by datasets' save_to_disk") from None
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    wanted = split_name(spec, split)
    if wanted not in loaded:
        field = "train_split" if split == "train" else "eval_split"
        raise spec_error(f"{path} has no split {wanted!r} (splits: {', '.join(loaded)})",
                         path=("data", field), hint=f"set data.{field} to one of its splits")
    return loaded[wanted]


FORMAT = SavedDataset()
