"""Checking a loaded spec: JSON Schema (every error at once), cross-field rules, path resolution.

The cross-field rules live in modules of their concern (jobspec/spec/rules/, each technique's module
in jobspec/techniques/ and the few listed in `CROSS_FIELD_RULES`); this module runs the schema with
its did-you-mean hints, then that one list.

`load_and_validate(path, overrides)` is the one entry point the other commands use; it returns a
`ResolvedSpec` whose `.spec` has every default filled and every path absolute, or raises one
`SpecError` listing every problem with its file:line:col and a hint.
This module must stay light: no torch, deepspeed, transformers or mlflow.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar, cast

from jobspec import optimizers, techniques
from jobspec.data import record_checks
from jobspec.data.formats import HF_PREFIX, is_hub_name
from jobspec.errors import SpecError, SpecIssue, close_choices, did_you_mean
from jobspec.export import rules as export_rules
from jobspec.spec.freeform import freeform_issues
from jobspec.spec.loader import LoadedSpec, Position, load_spec
from jobspec.spec.overrides import apply_overrides
from jobspec.spec.rules import (
    batch,
    checkpoint,
    choices,
    data,
    data_sources,
    generation,
    model_type,
    offload,
    paths,
    precision,
    tracking,
)
from jobspec.spec.rules.base import (
    Rule,
    base_dir,
    coded,
    exists,
    get,
    local_path,
)
from jobspec.spec.schema import (
    filled_spec,
    has_type,
    object_branch,
    schema_types,
    shared_schema,
    subschema_at,
    type_name,
    types_text,
)
from jobspec.spec.types import JobSpec

T = TypeVar("T")

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass
class ResolvedSpec:
    """A valid spec: defaults filled, `extends` merged, paths absolute (docs/architecture.md)."""

    spec: JobSpec
    source: Path
    text: str
    positions: dict[tuple, Position] = field(default_factory=dict)
    key_positions: dict[tuple, Position] = field(default_factory=dict)
    # what the rules found worth saying without refusing (a rotary model past its trained length):
    # positioned, printed as `warning:` lines by validate, plan, compile and launch
    warnings: list[SpecIssue] = field(default_factory=list)

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
                   self.issue(issue.path, issue.message, issue.hint, code=issue.code)
                   for issue in error.issues]
        return SpecError(located)

    def located(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)`, a SpecError it raises placed at the spec's lines (`locate`): for a
        step after validation (deriving, planning, the launch's checks) whose refusals carry only
        their field's path."""
        try:
            return function(*args)
        except SpecError as err:
            raise self.locate(err) from None


def load_and_validate(path: str | os.PathLike, overrides: Iterable[str] = ()) -> ResolvedSpec:
    """Load, merge, override, validate and resolve one spec file."""
    return validate_spec(apply_overrides(load_spec(path), overrides))


def validate_spec(loaded: LoadedSpec) -> ResolvedSpec:
    """Every problem at once: the schema's; then the cross-field rules, the system locations and the
    data records, which run on a schema-valid spec. Unknown keys (a `trainig:` typo) are set aside
    for them, as no rule reads such a key; a value of the wrong type or not among the choices stops
    them, since they would judge a value that was not written."""
    # the schema checks run on the spec as written (not yet a JobSpec: filled_spec makes it one
    # below)
    resolved = ResolvedSpec(cast(JobSpec, loaded.spec), loaded.source, loaded.text,
                            loaded.positions, loaded.key_positions)
    issues = schema_issues(resolved) + coded(freeform_issues(resolved), "freeform")
    if issues:
        aside = _without_unknown_keys(resolved, issues)
        if aside is None:
            raise SpecError(issues)
        # a rule's issue inside the field an unknown key misspells (`training` for `trainig`) is the
        # typo's consequence (its settings unread), not a problem of its own
        meant = [_misspelt(issue.path) for issue in issues]
        raise SpecError(issues + [issue for issue in _rule_issues(aside)
                                  if not any(m and issue.path[:len(m)] == m for m in meant)])
    later = _rule_issues(resolved)
    if later:
        raise SpecError(later)
    return resolved


def _rule_issues(resolved: ResolvedSpec) -> list[SpecIssue]:
    """The checks after the schema, in order, each on a spec the ones before it passed: defaults
    filled and the cross-field rules, paths resolved and the system locations, every record of the
    local data files (data/record_checks: each bad one at its file:line, up to 20 a file).
    `resolved` becomes the resolved spec; [] when all pass."""
    resolved.spec = filled_spec(resolved.spec)
    model_type.fill_attention(resolved)   # left out: the best the model supports (sdpa, else eager)
    issues = cross_field_issues(resolved)
    if issues:
        return issues
    resolve_paths(resolved)
    issues = system_location_issues(resolved)
    if issues:
        return issues
    issues = coded(record_checks.record_issues(resolved.spec), "data-record")
    return resolved.locate(SpecError(issues)).issues if issues else []


def _misspelt(path: tuple) -> tuple | None:
    """The field an unknown key at `path` most likely misspells: its closest schema sibling."""
    parent = object_branch(subschema_at(path[:-1]) or {}) or {}
    close = close_choices(str(path[-1]), list(parent.get("properties", {})))
    return (*path[:-1], close[0]) if close else None


def _without_unknown_keys(resolved: ResolvedSpec, issues: list[SpecIssue]) -> ResolvedSpec | None:
    """A copy of `resolved` without the unknown keys `issues` name, when those are all its issues
    and the copy passes the schema; else None."""
    if any(issue.code != "schema-unknown-key" for issue in issues):
        return None
    spec: Any = copy.deepcopy(resolved.spec)
    for issue in issues:
        parent = spec
        for key in issue.path[:-1]:
            parent = parent[key] if isinstance(parent, (dict, list)) else None
        if not isinstance(parent, dict):
            return None
        parent.pop(issue.path[-1], None)
    aside = dataclasses.replace(resolved, spec=cast(JobSpec, spec))
    return aside if not schema_issues(aside) else None


def recheck(resolved: ResolvedSpec) -> ResolvedSpec:
    """Every rule again, on a resolved spec changed after validation (`memory.fit: auto`'s rewrite):
    the schema, model.config / deepspeed:, the cross-field rules and the system locations,
    positioned at the written field (or its nearest written ancestor). Returns `resolved`; SpecError
    otherwise."""
    issues = schema_issues(resolved) + coded(freeform_issues(resolved), "freeform")
    if not issues:
        issues = cross_field_issues(resolved) + system_location_issues(resolved)
    if issues:
        raise SpecError(issues)
    return resolved


# ---------------------------------------------------------------- JSON Schema

@lru_cache(maxsize=1)
def _validator() -> Any:
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
_SCHEMA_CODES = {"additionalProperties": "unknown-key", "enum": "enum", "type": "type",
                 "oneOf": "type",
                 "required": "required", "minimum": "range", "maximum": "range",
                 "exclusiveMinimum": "range",
                 "exclusiveMaximum": "range", "minItems": "items", "maxItems": "items",
                 "minLength": "empty", "pattern": "pattern"}


def _explain(error: Any, resolved: ResolvedSpec) -> list[SpecIssue]:
    """The issues of one schema error, coded `schema-<code>` by the keyword that failed (a oneOf's
    by its branch's)."""
    return coded(_explain_error(error, resolved),
                 f"schema-{_SCHEMA_CODES.get(error.validator, 'other')}")


def _explain_error(error: Any, resolved: ResolvedSpec) -> list[SpecIssue]:
    path = tuple(error.absolute_path)
    kind, value, schema = error.validator, error.instance, error.schema
    if kind == "additionalProperties":
        allowed = list(schema.get("properties", {}))
        return [resolved.issue(path + (key,), f"unknown key `{key}`",
                               did_you_mean(key, allowed, "keys here", beside=6), key=True)
                for key in value if key not in allowed]
    if kind == "oneOf":
        return _explain_one_of(error, resolved)
    field_schema = subschema_at(path) or {}
    if kind == "enum":
        return [resolved.issue(path, f"`{value}` is not an allowed value",
                               did_you_mean(str(value), [str(v) for v in error.validator_value],
                                            "allowed", beside=6))]
    if kind == "type":
        expected = error.validator_value
        expected = [expected] if isinstance(expected, str) else expected
        return [resolved.issue(path, f"expected {types_text(expected)}, got {_describe(value)}",
                               _type_hint(value, expected, field_schema))]
    if kind == "required":
        missing = [k for k in error.validator_value if k not in value]
        return [resolved.issue(path + (k,), f"missing required section `{k}`",
                               _first_sentence(subschema_at(path + (k,)) or {}), key=True)
                for k in missing]
    bounds = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
    if kind in bounds:
        return [resolved.issue(path, f"must be {bounds[kind]} {error.validator_value}, got {value}",
                               _first_sentence(field_schema))]
    if kind in ("minItems", "maxItems"):
        word = "at least" if kind == "minItems" else "at most"
        return [resolved.issue(path,
                               f"needs {word} {error.validator_value} item(s), got {len(value)}",
                               _first_sentence(field_schema))]
    if kind == "minLength":
        return [resolved.issue(path, "must not be empty", _first_sentence(field_schema))]
    if kind == "pattern":
        return [resolved.issue(path, f"`{value}` does not have the expected form",
                               f"it must match the regular expression `{error.validator_value}`")]
    return [resolved.issue(path, error.message[:200], _first_sentence(field_schema))]


def _explain_one_of(error: Any, resolved: ResolvedSpec) -> list[SpecIssue]:
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


# ---------------------------------------------------------------- cross-field rules

# Every cross-field rule, in the order its problems are listed: each a function (ResolvedSpec) ->
# list[SpecIssue], positioned and coded, in a module of its concern (jobspec/spec/rules/, the
# optimizers', export/rules). Adding a rule: its function, and one
# line here (docs/architecture.md, "Adding a cross-field rule").
# a technique's name stands for its rules (jobspec/techniques); `techniques.OTHERS` for those of
# the techniques named nowhere here
CROSS_FIELD_RULES: tuple[Rule, ...] = techniques.placed((
    choices.steps_or_epochs,
    choices.checkpoint_or_architecture,
    data_sources.data_source_issues,
    batch.batch_split_issues,
    offload.offload_issues,
    # each optimizer's own: offload, Adam fields, `momentum`
    optimizers.rule_issues,
    "packing",                               # data.packing: task, data, a model family
    "sequence_parallel",                     # memory.sequence_parallel: what Ulysses can wrap
    precision.flash_attention_issues,
    choices.warmup,
    "gradient_checkpointing",                # every_n_layers against the layer count
    data.data_rule_issues,                   # positions, formats, tokenizer, chat template
    "lora",                                  # model.lora / model.quantization / export.adapter
    # the task's head, LoRA module names, token ids (spec/model_table)
    model_type.model_type_issues,
    "quantization",                          # QLoRA: ZeRO 0-2 only
    precision.auto_cast_issues,
    generation.eval_generate_issues,         # training.eval_generate: causal-lm, prompts, room
    techniques.OTHERS,                       # the other techniques' (the tiled loss's)
    "fused_kernels",                         # model.kernels: liger: model type, CUDA GPU, package
    "torch_compile",                         # model.compile: ZeRO 0-2; no QLoRA, tiled MLP, offload
    export_rules.export_issues,
    tracking.system_metrics_issues,
    tracking.tracking_uri_issues,
    paths.nul_issues,
    checkpoint.resume_issues,
))


def cross_field_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """Rules one field's schema cannot express, on the defaults-filled spec: every rule's
    problems."""
    return [issue for rule in CROSS_FIELD_RULES for issue in rule(r)]


# ---------------------------------------------------------------- path resolution

def job_name(source: Path) -> str:
    """The spec file's stem, changed to fit the schema's `name` pattern."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(source).stem).lstrip("._-")[:100]
    return name if _NAME_PATTERN.match(name) else "job"


def resolve_paths(r: ResolvedSpec) -> None:
    s = r.spec
    name = s["name"]
    if name is None:
        name = s["name"] = job_name(r.source)
    s["extends"] = None
    for path in (("data", "train"), ("data", "eval"), ("data", "chat_template"), ("output_dir",),
                 ("checkpoint", "dir"), ("memory", "offload", "nvme_path"), ("export", "dir")):
        if is_hub_name(get(s, path)):   # hf:name; hf:DIR names a local directory, made absolute
            name = get(s, path)[len(HF_PREFIX):]
            local = Path(os.path.abspath(base_dir(r, path) / os.path.expanduser(name)))
            if exists(local):
                _put(s, path, HF_PREFIX + str(local))
        elif get(s, path) is not None:
            _put(s, path, str(local_path(r, path)))
    generate = s["training"].get("eval_generate")
    # a prompts file, relative to the spec file
    if generate and isinstance(generate["prompts"], str):
        generate["prompts"] = str(local_path(r, ("training", "eval_generate", "prompts")))
    # Hub ids and local directories look alike: only an existing local path is made absolute.
    for path in (("data", "tokenizer"), ("model", "name_or_path"), ("checkpoint", "resume")):
        value = get(s, path)
        if value is not None and value not in ("auto", "never") and exists(local_path(r, path)):
            _put(s, path, str(local_path(r, path)))
    if s["logging"]["mlflow"]["experiment"] is None:
        s["logging"]["mlflow"]["experiment"] = s["name"]
    # the schema's default (true) is for a job with a run
    if not s["logging"]["mlflow"]["enabled"]:
        s["logging"]["system_metrics"] = False
    output_dir = s["output_dir"]
    if output_dir is None:
        output_dir = s["output_dir"] = str(Path.cwd() / "runs" / name)
    if s["checkpoint"]["dir"] is None:
        s["checkpoint"]["dir"] = str(Path(output_dir) / "checkpoints")


# Writing checkpoints or runs here would damage the system (or, as root, succeed at it).
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/boot", "/proc",
                "/sys", "/dev")
# not below them
SYSTEM_DIRS = ("/", "/var", "/home", "/root", "/opt", "/run", "/mnt", "/media", "/srv")
WRITTEN_DIRS = (("output_dir",), ("checkpoint", "dir"), ("memory", "offload", "nvme_path"),
                ("export", "dir"))


def system_location_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """Directories jobspec writes into must not be, or lie in, a system location (symlinks
    followed)."""
    issues = []
    for path in WRITTEN_DIRS:
        value = get(r.spec, path)
        if value is None:
            continue
        for candidate in {os.path.normpath(value), os.path.realpath(value)}:
            tree = next((t for t in SYSTEM_TREES if candidate == t
                         or candidate.startswith(t + "/")), None)
            if tree is not None or candidate in SYSTEM_DIRS:
                where = f"is inside {tree}" if tree and candidate != tree \
                    else "is a system directory"
                issues.append(r.issue(path, f"{candidate} {where}; jobspec will not write there",
                                      "use a directory of your own, e.g. under your home or a "
                                      "project directory",
                                      code="system-directory"))
                break
    return issues


def _put(spec: JobSpec, path: tuple, value: Any) -> None:
    get(spec, path[:-1])[path[-1]] = value
