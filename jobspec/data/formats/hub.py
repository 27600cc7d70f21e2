"""`hf:org/name`: a dataset by name, `datasets.load_dataset(name, data.subset,
split=data.train_split / data.eval_split)` through the Hugging Face cache; offline
(HF_DATASETS_OFFLINE=1 or HF_HUB_OFFLINE=1) it reads the cache only, as datasets does. `hf:`
followed by a local directory (made absolute against the spec file) loads that directory: a
`save_to_disk` one with `load_from_disk`, else as a dataset repository. Read by the ranks (and the
preparation pass), never by validate."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from jobspec.data.formats.base import split_name, split_source
from jobspec.data.formats.saved import SavedDataset, is_saved_dataset, load_saved
from jobspec.errors import first_line, spec_error
from jobspec.spec.types import JobSpec

HF_PREFIX = "hf:"


class HubDataset(SavedDataset):
    name = "hub"

    @property
    def described(self) -> str:
        return "a dataset by name"

    def claims(self, source: str) -> bool:
        return is_hub_name(source)

    def dataset(self, spec: JobSpec, split: str) -> Any:
        import datasets

        name = split_source(spec["data"], split)[len(HF_PREFIX):]
        local = Path(name).expanduser()
        if local.is_absolute() and is_saved_dataset(local):
            return load_saved(spec, split, str(local))
        wanted = split_name(spec, split)
        try:
            return datasets.load_dataset(name, spec["data"].get("subset"), split=wanted)
        except Exception as err:   # not found, offline with nothing cached, no such subset or split
            raise _load_error(split, name, first_line(err)) from None


def is_hub_name(source) -> bool:
    """`hf:org/name`: a dataset by name (datasets.load_dataset), never a local path of the
    spec's."""
    return isinstance(source, str) and source.startswith(HF_PREFIX)


def _load_error(split: str, name: str, text: str):
    hint = ("check the name, data.subset and data.train_split / data.eval_split; offline "
            "(HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1) only what the Hugging Face cache holds "
            "loads")
    if "split" in text.lower():
        return spec_error(f"{HF_PREFIX}{name}: {text}", hint=hint,
                          path=("data", "train_split" if split == "train" else "eval_split"))
    if "config" in text.lower():
        return spec_error(f"{HF_PREFIX}{name}: {text}", path=("data", "subset"), hint=hint)
    return spec_error(f"cannot load the dataset {HF_PREFIX}{name}: {text}", path=("data", split),
                      hint=hint)


FORMAT = HubDataset()
