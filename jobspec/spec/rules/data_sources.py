"""Where the training and evaluation data come from: synthetic tokens or files, exactly one;
evaluation files only beside training files; a tokenizer for file data and a fresh model; data files
and directories that exist and hold data. (What the data holds is spec/rules/data's and
data/record_checks's.)"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobspec.data.formats import is_hub_name, source_format
from jobspec.errors import SpecIssue
from jobspec.spec.rules.base import exists, local_path

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def data_source_issues(r: ResolvedSpec) -> list[SpecIssue]:
    model, data = r.spec["model"], r.spec["data"]
    issues: list[SpecIssue] = []
    if data["synthetic"] is None and data["train"] is None:
        issues.append(r.issue(("data",), "no training data",
                              "set `data.train` to a file, or `data.synthetic: {}`",
                              key=True, code="no-train-data"))
    elif data["synthetic"] is not None and data["train"] is not None:
        issues.append(r.issue(("data", "synthetic"), "`synthetic` and `train` are exclusive",
                              "remove `data.synthetic` to train on the file, or `data.train` for "
                              "random tokens",
                              key=True, code="synthetic-or-file"))
    if data["eval"] is not None and data["train"] is None:
        issues.append(r.issue(("data", "eval"), "`data.eval` needs `data.train`",
                              "synthetic data sets its evaluation size with "
                              "`data.synthetic.eval_samples`", key=True,
                              code="eval-needs-train"))
    if data["train"] is not None and model["architecture"] is not None \
            and data["tokenizer"] is None:
        issues.append(r.issue(("data", "train"),
                              "file data with `model.architecture` needs `data.tokenizer`",
                              "set `data.tokenizer` to a hub id or a local tokenizer directory",
                              key=True, code="file-data-tokenizer"))
    for key in ("train", "eval"):
        source = data["train"] if key == "train" else data["eval"]
        if isinstance(source, str) and not is_hub_name(source):   # hf:name is no path of the spec's
            issues += _file_issues(r, key)
    return issues


def _file_issues(r: ResolvedSpec, key: str) -> list[SpecIssue]:
    file = local_path(r, ("data", key))
    if exists(file) and file.is_dir():
        setting = r.spec["data"]["format"]
        if source_format(file, setting).files(str(file), setting):   # a saved dataset, text files
            return []
        return [r.issue(("data", key),
                        f"{file} is a directory, not a data file (it holds no text files "
                        "and no saved dataset)",
                        f"point data.{key} at a data file, a directory of text "
                        "files or a save_to_disk directory", code="data-file")]
    if not exists(file, file=True):
        return [r.issue(("data", key), f"data file not found: {file}",
                        "paths are relative to the spec file that sets them", code="data-file")]
    return []
