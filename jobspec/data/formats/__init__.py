"""The data formats a job reads: one module each in this package, found here by their `FORMAT`.

Each module declares a `DataFormat` (jobspec/data/formats/base.py): the file formats `data.format`
names (jsonl, csv, parquet, text: the schema's enum, `tests/test_registries.py`), and the sources
told by themselves (`hf:` names, `save_to_disk` directories). Validate's record checks, the derived
job's row count, the data pre-flight, the preparation pass, the loaders and generation's prompts ask
the source's format (`source_format`) what they need, never its name. Adding a format: the schema's
enum and one module here (docs/architecture.md, "Adding a data format"); nothing to register.

A data source (`data.train`, `data.eval`) is a file, a directory of text files, or a dataset by name
(`hf:org/name`, or a local `save_to_disk` directory): `source_format` tells which without reading
it. Pure: no torch, no datasets, no pyarrow at import.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from jobspec.data.formats.base import DataFormat, split_source
from jobspec.data.formats.hub import HF_PREFIX, is_hub_name
from jobspec.data.formats.saved import is_saved_dataset
from jobspec.data.formats.text import text_files
from jobspec.errors import spec_error
from jobspec.spec.types import JobSpecData


def _declared() -> dict[str, DataFormat]:
    """Every module of this package that declares a `FORMAT`, by the format's name."""
    found: dict[str, DataFormat] = {}
    for module in pkgutil.iter_modules(__path__):
        declared = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FORMAT", None)
        if isinstance(declared, DataFormat):
            found[declared.name] = declared
    return found


FORMATS: dict[str, DataFormat] = _declared()
FORMAT_BY_SUFFIX = {suffix: f for f in FORMATS.values() if f.schema_value for suffix in f.suffixes}
TEXT_SUFFIXES = tuple(suffix for suffix, f in FORMAT_BY_SUFFIX.items() if not f.holds_records)


def schema_formats() -> list[str]:
    """The formats `data.format` may name (besides `auto`)."""
    return [name for name, f in FORMATS.items() if f.schema_value]


def listed(names: list[str]) -> str:
    """`a, b or c`."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


def named_format(setting: str) -> DataFormat | None:
    """The format `data.format` names; None for `auto` (the file's extension tells)."""
    return None if setting == "auto" else FORMATS[setting]


def file_format(path: str | Path, setting: str = "auto") -> DataFormat:
    """The format `data.format` names (`setting`), or for `auto` the one `path`'s extension names;
    SpecError when it names none."""
    if setting != "auto":
        return FORMATS[setting]
    found = FORMAT_BY_SUFFIX.get(Path(path).suffix.lower())
    if found is None:
        raise spec_error(f"cannot tell the format of {Path(path).name} from its extension",
                         path=("data", "format"),
                         hint=f"set data.format to {listed(schema_formats())}")
    return found


def source_format(source: str | Path, setting: str = "auto") -> DataFormat:
    """The format of a data source: the one that claims it (`hf:` names, saved datasets, directories
    of text files), else the file's (SpecError when `auto` cannot tell it)."""
    claimed = next((f for f in FORMATS.values() if f.claims(str(source))), None)
    return claimed if claimed is not None else file_format(source, setting)


def split_format(data: JobSpecData, split: str) -> DataFormat:
    """The format of `data.<split>`."""
    return source_format(split_source(data, split), data["format"])


def count_rows(path: str | Path, setting: str = "auto") -> int:
    """Training samples in a file of a counted format (its records: blank jsonl lines and the csv
    header excluded)."""
    path = Path(path)
    try:
        return file_format(path, setting).count_rows(path)
    except (OSError, ValueError, ImportError) as err:   # UnicodeDecodeError, a csv's: ValueErrors
        raise spec_error(f"cannot count the rows of {path}: {err}", path=("data", "train"),
                         hint="check the file and data.format") from None


__all__ = ["FORMATS", "HF_PREFIX", "DataFormat", "count_rows", "file_format", "is_hub_name",
           "is_saved_dataset", "listed", "named_format", "schema_formats", "source_format",
           "split_format", "split_source", "text_files"]
