"""Checking a loaded spec: JSON Schema (every error at once), cross-field rules, path resolution.

`load_and_validate(path, overrides)` is the one entry point the other commands use; it returns a
`ResolvedSpec` whose `.spec` has every default filled and every path absolute, or raises one
`SpecError` listing every problem with its file:line:col and a hint.
This module must stay light: no torch, deepspeed, transformers or mlflow.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from jobspec import optimizers
from jobspec.errors import SpecError, SpecIssue
from jobspec.spec import data_rules, lora_rules
from jobspec.spec.data_format import HF_PREFIX, is_hub_name, is_saved_dataset, text_files
from jobspec.spec.derived import derive
from jobspec.spec.freeform import freeform_issues, local_checkpoint_config
from jobspec.spec.loader import SET_FILE, LoadedSpec, Position, load_spec
from jobspec.spec.offload_rules import offload_problems
from jobspec.spec.packing_rules import packing_issues
from jobspec.spec.overrides import apply_overrides
from jobspec.spec.schema import (
    fill_defaults,
    has_type,
    schema_types,
    shared_schema,
    subschema_at,
    type_name,
    types_text,
)

PATH_FIELDS = (("data", "train"), ("data", "eval"), ("data", "tokenizer"), ("data", "chat_template"),
               ("model", "name_or_path"),
               ("output_dir",), ("checkpoint", "dir"), ("checkpoint", "resume"), ("memory", "offload", "nvme_path"),
               ("export", "dir"))
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_URI_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# MLflow tracking stores; the database ones are SQLAlchemy URIs like sqlite:///.
_TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "databricks", "databricks-uc",
                     "postgresql", "mysql", "mssql")


@dataclass
class ResolvedSpec:
    """A valid spec: defaults filled, `extends` merged, paths absolute (docs/architecture.md)."""

    spec: dict
    source: Path
    text: str
    positions: dict[tuple, Position] = field(default_factory=dict)
    key_positions: dict[tuple, Position] = field(default_factory=dict)

    def position(self, path: tuple | list, key: bool = False) -> Position:
        """Where `path` was written; for a defaulted field, its nearest written ancestor.

        `key=True` prefers the key's position (`memory:`) over the value's.
        """
        path = tuple(path)
        for n in range(len(path), 0, -1):
            prefix = path[:n]
            if (key or n < len(path)) and prefix in self.key_positions:
                return self.key_positions[prefix]   # an ancestor: point at its `section:` line
            if prefix in self.positions:
                return self.positions[prefix]
        return Position(str(self.source), 1, 1)

    def issue(self, path: tuple, message: str, hint: str | None = None, key: bool = False,
              code: str | None = None) -> SpecIssue:
        where = self.position(path, key=key)
        return SpecIssue(path=tuple(path), message=message, hint=hint, file=where.file,
                         line=where.line, column=where.col, code=code)


    def locate(self, error: SpecError) -> SpecError:
        """`error` with a file:line:col for each issue raised without one (e.g. by the compiler)."""
        located = [issue if issue.file is not None else
                   self.issue(issue.path, issue.message, issue.hint, code=issue.code) for issue in error.issues]
        return SpecError(located)


def load_and_validate(path: str | os.PathLike, overrides=()) -> ResolvedSpec:
    """Load, merge, override, validate and resolve one spec file."""
    return validate_spec(apply_overrides(load_spec(path), overrides))


def validate_spec(loaded: LoadedSpec) -> ResolvedSpec:
    """Schema errors first (all of them); cross-field rules only on a schema-valid spec."""
    resolved = ResolvedSpec(loaded.spec, loaded.source, loaded.text, loaded.positions, loaded.key_positions)
    issues = schema_issues(resolved) + _coded(freeform_issues(resolved), "freeform")
    if issues:
        raise SpecError(issues)
    resolved.spec = fill_defaults(loaded.spec)
    issues = cross_field_issues(resolved)
    if issues:
        raise SpecError(issues)
    resolve_paths(resolved)
    issues = system_location_issues(resolved)
    if issues:
        raise SpecError(issues)
    return resolved


def recheck(resolved: ResolvedSpec) -> ResolvedSpec:
    """Every rule again, on a resolved spec changed after validation (`memory.fit: auto`'s rewrite):
    the schema, model.config / deepspeed:, the cross-field rules and the system locations, positioned
    at the written field (or its nearest written ancestor). Returns `resolved`; SpecError otherwise."""
    issues = schema_issues(resolved) + _coded(freeform_issues(resolved), "freeform")
    if not issues:
        issues = cross_field_issues(resolved) + system_location_issues(resolved)
    if issues:
        raise SpecError(issues)
    return resolved


def _coded(issues: list[SpecIssue], code: str) -> list[SpecIssue]:
    """`issues`, each without a rule code given `code`."""
    return [issue if issue.code else replace(issue, code=code) for issue in issues]


# ---------------------------------------------------------------- JSON Schema

@lru_cache(maxsize=1)
def _validator():
    import jsonschema  # ~60 ms; only paid by commands that validate

    base = jsonschema.Draft202012Validator
    # JSON Schema counts 2.0 as an integer; a batch size of 2.0 would reach DeepSpeed as a float.
    strict_int = base.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    return jsonschema.validators.extend(base, type_checker=strict_int)(shared_schema())


def schema_issues(resolved: ResolvedSpec) -> list[SpecIssue]:
    issues: list[SpecIssue] = []
    for error in _validator().iter_errors(resolved.spec):
        issues += _explain(error, resolved)
    return issues


# the rule code of a schema error, by the JSON Schema keyword that failed (`schema-<code>`)
_SCHEMA_CODES = {"additionalProperties": "unknown-key", "enum": "enum", "type": "type", "oneOf": "type",
                 "required": "required", "minimum": "range", "maximum": "range", "exclusiveMinimum": "range",
                 "exclusiveMaximum": "range", "minItems": "items", "maxItems": "items", "minLength": "empty",
                 "pattern": "pattern"}


def _explain(error, resolved: ResolvedSpec) -> list[SpecIssue]:
    """The issues of one schema error, coded `schema-<code>` by the keyword that failed (a oneOf's by
    its branch's)."""
    return _coded(_explain_error(error, resolved), f"schema-{_SCHEMA_CODES.get(error.validator, 'other')}")


def _explain_error(error, resolved: ResolvedSpec) -> list[SpecIssue]:
    path = tuple(error.absolute_path)
    kind, value, schema = error.validator, error.instance, error.schema
    if kind == "additionalProperties":
        allowed = list(schema.get("properties", {}))
        return [resolved.issue(path + (key,), f"unknown key `{key}`", _did_you_mean(key, allowed, "keys here"),
                               key=True)
                for key in value if key not in allowed]
    if kind == "oneOf":
        return _explain_one_of(error, resolved)
    field_schema = subschema_at(path) or {}
    if kind == "enum":
        return [resolved.issue(path, f"`{value}` is not an allowed value",
                               _did_you_mean(str(value), [str(v) for v in error.validator_value], "allowed"))]
    if kind == "type":
        expected = error.validator_value
        expected = [expected] if isinstance(expected, str) else expected
        return [resolved.issue(path, f"expected {types_text(expected)}, got {_describe(value)}",
                               _type_hint(value, expected, field_schema))]
    if kind == "required":
        missing = [k for k in error.validator_value if k not in value]
        return [resolved.issue(path + (k,), f"missing required section `{k}`",
                               _first_sentence(subschema_at(path + (k,)) or {}), key=True) for k in missing]
    bounds = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
    if kind in bounds:
        return [resolved.issue(path, f"must be {bounds[kind]} {error.validator_value}, got {value}",
                               _first_sentence(field_schema))]
    if kind in ("minItems", "maxItems"):
        word = "at least" if kind == "minItems" else "at most"
        return [resolved.issue(path, f"needs {word} {error.validator_value} item(s), got {len(value)}",
                               _first_sentence(field_schema))]
    if kind == "minLength":
        return [resolved.issue(path, "must not be empty", _first_sentence(field_schema))]
    if kind == "pattern":
        return [resolved.issue(path, f"`{value}` does not have the expected form",
                               f"it must match the regular expression `{error.validator_value}`")]
    return [resolved.issue(path, error.message[:200], _first_sentence(field_schema))]


def _explain_one_of(error, resolved: ResolvedSpec) -> list[SpecIssue]:
    # jsonschema reports "not valid under any of the given schemas"; the useful errors are those of
    # the branch whose type the value has (e.g. the mapping branch for a mapping).
    path, value = tuple(error.absolute_path), error.instance
    for index, branch in enumerate(error.validator_value):
        nested = [e for e in error.context if e.relative_schema_path[0] == index]
        if has_type(value, schema_types(branch)) and nested:
            return [issue for sub in nested for issue in _explain(sub, resolved)]
    expected = [t for branch in error.validator_value for t in schema_types(branch)]
    return [resolved.issue(path, f"expected {types_text(expected)}, got {_describe(value)}",
                           _first_sentence(error.schema))]


def _describe(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list, type(None))) else ""
    if isinstance(value, bool):
        text = str(value).lower()
    return f"{type_name(value)} {text[:40]}".rstrip() if text else type_name(value)


def _type_hint(value: Any, expected: list[str], field_schema: dict) -> str:
    if "string" in expected and isinstance(value, bool):
        return "YAML reads yes/no/on/off/true/false as booleans: put the text in quotes"
    if "string" in expected and isinstance(value, (int, float)):
        return "put the text in quotes"
    if "integer" in expected and isinstance(value, float) and value.is_integer():
        return f"write {int(value)} without a decimal point"
    if isinstance(value, str) and ("integer" in expected or "number" in expected):
        return "write the number without quotes"
    return _first_sentence(field_schema) or "change the value's type"


def _first_sentence(node: dict) -> str | None:
    text = node.get("description")
    return text.split(". ")[0].rstrip(".") if text else None


def _did_you_mean(word: str, choices: list[str], label: str) -> str:
    lowered = {c.lower(): c for c in choices}
    close = ([lowered[word.lower()]] if word.lower() in lowered else
             difflib.get_close_matches(word, choices, n=1, cutoff=0.6))
    listing = ", ".join(f"`{c}`" for c in choices)
    if close:
        return f"did you mean `{close[0]}`?" + (f" {label}: {listing}" if len(choices) <= 6 else "")
    return f"{label}: {listing}"


# ---------------------------------------------------------------- cross-field rules

def cross_field_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """Rules one field's schema cannot express, on the defaults-filled spec."""
    s = r.spec
    model, data, training, memory = s["model"], s["data"], s["training"], s["memory"]
    issues: list[SpecIssue] = []
    add = issues.append

    def exactly_one(section: str, a: str, b: str, what: str, code: str) -> None:
        values = s[section]
        if values[a] is None and values[b] is None:
            add(r.issue((section,), f"set either `{a}` or `{b}`", f"{what}", key=True, code=code))
        elif values[a] is not None and values[b] is not None:
            add(r.issue((section, b), f"`{a}` and `{b}` are exclusive", f"remove one: {what}", key=True, code=code))

    exactly_one("training", "max_steps", "epochs", "train for a number of optimizer steps or of epochs",
                "steps-or-epochs")
    exactly_one("model", "name_or_path", "architecture",
                "load a checkpoint (name_or_path) or build a fresh model from a config (architecture)",
                "checkpoint-or-architecture")

    if data["synthetic"] is None and data["train"] is None:
        add(r.issue(("data",), "no training data", "set `data.train` to a file, or `data.synthetic: {}`", key=True,
                    code="no-train-data"))
    elif data["synthetic"] is not None and data["train"] is not None:
        add(r.issue(("data", "synthetic"), "`synthetic` and `train` are exclusive",
                    "remove `data.synthetic` to train on the file, or `data.train` for random tokens", key=True,
                    code="synthetic-or-file"))
    if data["eval"] is not None and data["train"] is None:
        add(r.issue(("data", "eval"), "`data.eval` needs `data.train`",
                    "synthetic data sets its evaluation size with `data.synthetic.eval_samples`", key=True,
                    code="eval-needs-train"))
    if data["train"] is not None and model["architecture"] is not None and data["tokenizer"] is None:
        add(r.issue(("data", "train"), "file data with `model.architecture` needs `data.tokenizer`",
                    "set `data.tokenizer` to a hub id or a local tokenizer directory", key=True,
                    code="file-data-tokenizer"))
    for key in ("train", "eval"):
        if isinstance(data[key], str) and not is_hub_name(data[key]):   # hf:name is no path of the spec's
            file = _local_path(r, ("data", key))
            if _exists(file) and file.is_dir():
                if not (is_saved_dataset(file) or text_files(file, data["format"])):
                    add(r.issue(("data", key), f"{file} is a directory, not a data file (it holds no text files "
                                "and no saved dataset)", f"point data.{key} at a data file, a directory of text "
                                "files or a save_to_disk directory", code="data-file"))
            elif not _exists(file, file=True):
                add(r.issue(("data", key), f"data file not found: {file}",
                            "paths are relative to the spec file that sets them", code="data-file"))

    derived = None
    try:
        # the batch split and the model's dimensions are derived in one place; the split's problems
        # are reported here, positioned
        derived = derive(s, config_json=local_checkpoint_config(r))
    except SpecError as err:
        for problem in err.issues:
            add(r.issue(problem.path, problem.message, problem.hint, code=problem.code or "batch-split"))
    except (TypeError, ValueError, ZeroDivisionError):
        pass   # model.config values of the wrong type: reported by the model.config check

    for path, message, hint in offload_problems(memory):
        add(r.issue(path, message, hint, code=offload_code(path, message)))
    # each optimizer's own rules (jobspec/optimizers): offload, the Adam fields, `momentum`
    issues += optimizers.rule_issues(r)
    issues += packing_issues(r)   # data.packing: task, data, model family (spec/packing_rules)
    if model["attention"] == "flash_attention_2" and memory["precision"] == "fp32":
        add(r.issue(("model", "attention"), "flash_attention_2 needs fp16 or bf16",
                    "set `memory.precision: bf16` (or fp16), or use `attention: sdpa`", code="flash-attention-fp32"))
    scheduler = training["scheduler"]
    if scheduler["warmup_steps"] and scheduler["warmup_ratio"]:
        add(r.issue(("training", "scheduler", "warmup_ratio"), "`warmup_steps` and `warmup_ratio` are exclusive",
                    "keep one of them", code="warmup-exclusive"))
    checkpointing = memory["activation_checkpointing"]
    layers = derived.num_layers if derived is not None else None   # None: unknown (no hidden size, say)
    if isinstance(checkpointing, dict) and layers is not None and checkpointing["every_n_layers"] > layers:
        add(r.issue(("memory", "activation_checkpointing", "every_n_layers"),
                    f"every_n_layers = {checkpointing['every_n_layers']} but the model has {layers} layers",
                    f"use a value between 1 and {layers}", code="checkpointing-layers"))
    issues += data_rules.data_rule_issues(r)   # positions, formats, tokenizer, chat template (spec/data_rules)
    issues += lora_rules.lora_issues(r)        # model.lora / model.quantization / export.adapter
    from jobspec.export import rules as export_rules
    issues += (_coded(export_rules.precision_issues(r), "fp16-auto-cast")
               + _coded(export_rules.export_issues(r), "export-best"))
    written = ("logging", "system_metrics") in r.positions   # else its default: off with MLflow off (resolve_paths)
    if written and s["logging"]["system_metrics"] and not s["logging"]["mlflow"]["enabled"]:
        add(r.issue(("logging", "system_metrics"), "system metrics are recorded in the MLflow run, and MLflow is off",
                    "set `logging.mlflow.enabled: true`, or `logging.system_metrics: false`, "
                    "its default with MLflow off",
                    code="system-metrics-mlflow"))
    uri_problem = _tracking_uri_problem(s["logging"]["mlflow"]["tracking_uri"])
    if uri_problem:
        add(r.issue(("logging", "mlflow", "tracking_uri"), *uri_problem, code="tracking-uri"))
    for path in PATH_FIELDS:
        value = _get(s, path)
        if isinstance(value, str) and "\0" in value:
            add(r.issue(path, "a path cannot contain a NUL character", "remove the `\\0` escape", code="path-nul"))
    resume = s["checkpoint"]["resume"]
    if resume not in ("auto", "never") and not _exists(_local_path(r, ("checkpoint", "resume"))):
        close = difflib.get_close_matches(resume.lower(), ["auto", "never"], n=1, cutoff=0.5)
        add(r.issue(("checkpoint", "resume"),
                    f"`{resume[:80]}` is neither `auto`, `never` nor an existing checkpoint path",
                    f"did you mean `{close[0]}`?" if close else "use `auto`, `never` or the path of a checkpoint",
                    code="checkpoint-resume"))
    return issues


def offload_code(path: tuple, message: str) -> str:
    """The rule code of an offload problem (spec.offload_rules): the stage it needs, or the NVMe path."""
    return "offload-nvme-path" if "nvme_path" in message else f"offload-{path[-1]}-stage"


def _tracking_uri_problem(uri: str) -> tuple[str, str] | None:
    schemes = ", ".join(f"{s}:" for s in _TRACKING_SCHEMES)
    if not uri.strip():
        return "empty tracking URI", "use e.g. `sqlite:///mlflow.db`, `http://host:5000` or a directory"
    if uri in ("databricks", "databricks-uc"):
        return None
    match = _URI_SCHEME.match(uri)
    if match is None or len(match.group(1)) == 1:   # no scheme (or a Windows drive): a directory
        return None
    scheme = match.group(1).lower().split("+")[0]
    if scheme not in _TRACKING_SCHEMES:
        return (f"`{match.group(1)}:` is not a tracking URI scheme MLflow knows",
                _did_you_mean(scheme, list(_TRACKING_SCHEMES), "use one of") + f" ({schemes} or a path)")
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        return "a SQLite tracking URI needs three slashes", "e.g. `sqlite:///mlflow.db` (four for an absolute path)"
    if scheme in ("http", "https") and not re.match(r"^https?://[^/\s]+", uri):
        return "an http(s) tracking URI needs a host", "e.g. `http://mlflow.example.com:5000`"
    return None


# ---------------------------------------------------------------- path resolution

def _base_dir(r: ResolvedSpec, path: tuple) -> Path:
    """Relative paths are relative to the file that wrote them; `--set` ones to the current directory."""
    where = r.positions.get(path)
    if where is None or where.file == SET_FILE:
        return Path.cwd() if where is not None else Path(r.source).resolve().parent
    return Path(where.file).resolve().parent


def _local_path(r: ResolvedSpec, path: tuple) -> Path:
    value: Any = r.spec
    for key in path:
        value = value[key]
    return Path(os.path.abspath(_base_dir(r, path) / os.path.expanduser(value)))


def _exists(path: Path, file: bool = False) -> bool:
    try:
        return path.is_file() if file else path.exists()
    except (OSError, ValueError):   # a name too long, or with a NUL byte, names nothing
        return False


def job_name(source: Path) -> str:
    """The spec file's stem, changed to fit the schema's `name` pattern."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(source).stem).lstrip("._-")[:100]
    return name if _NAME_PATTERN.match(name) else "job"


def resolve_paths(r: ResolvedSpec) -> None:
    s = r.spec
    if s["name"] is None:
        s["name"] = job_name(r.source)
    s["extends"] = None
    for path in (("data", "train"), ("data", "eval"), ("data", "chat_template"), ("output_dir",),
                 ("checkpoint", "dir"), ("memory", "offload", "nvme_path"), ("export", "dir")):
        if is_hub_name(_get(s, path)):   # hf:name; hf:DIR names a local directory, made absolute
            name = _get(s, path)[len(HF_PREFIX):]
            local = Path(os.path.abspath(_base_dir(r, path) / os.path.expanduser(name)))
            if _exists(local):
                _put(s, path, HF_PREFIX + str(local))
        elif _get(s, path) is not None:
            _put(s, path, str(_local_path(r, path)))
    # Hub ids and local directories look alike: only an existing local path is made absolute.
    for path in (("data", "tokenizer"), ("model", "name_or_path"), ("checkpoint", "resume")):
        value = _get(s, path)
        if value is not None and value not in ("auto", "never") and _exists(_local_path(r, path)):
            _put(s, path, str(_local_path(r, path)))
    if s["logging"]["mlflow"]["experiment"] is None:
        s["logging"]["mlflow"]["experiment"] = s["name"]
    if not s["logging"]["mlflow"]["enabled"]:   # the schema's default (true) is for a job with a run
        s["logging"]["system_metrics"] = False
    if s["output_dir"] is None:
        s["output_dir"] = str(Path.cwd() / "runs" / s["name"])
    if s["checkpoint"]["dir"] is None:
        s["checkpoint"]["dir"] = str(Path(s["output_dir"]) / "checkpoints")


# Writing checkpoints or runs here would damage the system (or, as root, succeed at it).
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/boot", "/proc", "/sys", "/dev")
SYSTEM_DIRS = ("/", "/var", "/home", "/root", "/opt", "/run", "/mnt", "/media", "/srv")  # not below them
WRITTEN_DIRS = (("output_dir",), ("checkpoint", "dir"), ("memory", "offload", "nvme_path"), ("export", "dir"))


def system_location_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """Directories jobspec writes into must not be, or lie in, a system location (symlinks followed)."""
    issues = []
    for path in WRITTEN_DIRS:
        value = _get(r.spec, path)
        if value is None:
            continue
        for candidate in {os.path.normpath(value), os.path.realpath(value)}:
            tree = next((t for t in SYSTEM_TREES if candidate == t or candidate.startswith(t + "/")), None)
            if tree is not None or candidate in SYSTEM_DIRS:
                where = f"is inside {tree}" if tree and candidate != tree else "is a system directory"
                issues.append(r.issue(path, f"{candidate} {where}; jobspec will not write there",
                                      "use a directory of your own, e.g. under your home or a project directory",
                                      code="system-directory"))
                break
    return issues


def _get(spec: dict, path: tuple):
    for key in path:
        spec = spec[key]
    return spec


def _put(spec: dict, path: tuple, value) -> None:
    _get(spec, path[:-1])[path[-1]] = value
