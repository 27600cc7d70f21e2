"""The model and data refusals `plan`, `compile` and `launch` (dry or not) make before anything is
derived.

One function, `model_data_checks(resolved)`, run by job/prepare.prepare_job on every path
(`jobspec plan`, `jobspec compile`, `jobspec launch` and `--dry-run`, `jobspec prepare`), so none of
them can plan, compile or start a model other than the one written. What it adds to validate's
rules is what needs transformers or the network (validate imports neither):

- `model.config` of a hub id (its config.json names the type) or of a type the generated table
  lacks: job/model_config, with the positioned errors validate gives;
- the config transformers builds from it, refused at the keys involved (model/build.build_config:
  `pad_token_id` beyond `vocab_size`, ...), never as a later failure of another field;
- `model.attention` left out for a hub id: the best the head supports, now that its type is known;
- (the records' shape: validate, data/record_checks.record_issues, every bad record at its
  file:line)
- the tokenizer transformers loads, its size against the vocabulary, the chat template rendered on
  the records (data/preflight).

`lora_target_check`, run by prepare_job whether or not the other checks are: `model.lora`'s target
patterns against the meta-built model (model/lora.check_targets).

Once they all passed for a spec (`plan`: the config transformers builds included), prepare_job
records it in the plan cache (`record_checks`); a later plan, compile or launch of the same spec,
files and environment skips them (`checks_passed`), so its warm path imports neither torch nor
transformers. The mark's key (`checks_key`) is memory/plan_cache.spec_digest of the spec with the
local files the checks read; a model or tokenizer named by hub id has none (the checks read the
hub every time).

What only a launch checks is the host's (port, GPUs, disk, lease, bitsandbytes' CPU backend):
launch/pipeline.launch_checks and host_checks, and tests/test_refusals.py says so per site.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jobspec import library_log
from jobspec.data import preflight as data_preflight
from jobspec.data.tokenizer_files import tokenizer_name
from jobspec.errors import SpecError
from jobspec.job.model_config import job_model_config_issues
from jobspec.memory.plan_cache import path_state, read_entry, spec_digest, write_entry
from jobspec.spec.types import JobSpec

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def model_data_checks(resolved: ResolvedSpec, plan: bool = True, passed: bool = False) -> None:
    """Raise SpecError (positioned) for the first group of problems found. `plan`: the model will be
    built (plan, launch): the config transformers builds is checked first, at the config keys.
    `jobspec compile` (no plan) leaves that one out: AutoConfig imports torch (~8 s), compile stays
    light, and validate has checked every key, type and the padding id against the generated table.
    `passed`: the plan cache says these checks passed for this very spec (`checks_passed`): only
    validate's warnings are said."""
    for warning in resolved.warnings:   # validate's, said by plan, compile and launch too
        print(f"jobspec: warning: {warning.render()}", file=sys.stderr)
    if passed:
        return
    model = resolved.spec["model"]
    if model["config"] and model["name_or_path"]:
        library_log.adopt_transformers()   # a hub config read: its log lines to the command's log
    problems = job_model_config_issues(resolved)
    if problems:
        raise SpecError(problems)
    if plan:
        config_check(resolved)
    tokenizer_problems = data_preflight.tokenizer_issues(resolved)
    if tokenizer_problems:
        raise SpecError(tokenizer_problems)


def config_check(resolved: ResolvedSpec) -> None:
    """The config transformers builds from the spec (AutoConfig with `model.config`), and the model
    built from it on the meta device (embeddings and heads check ids against sizes), refused at the
    config keys involved. Architectures only: a checkpoint's config is the ranks' to load (its
    weights decide), and jobspec's mlp is checked by validate."""
    model = resolved.spec["model"]
    if not model["architecture"] or model["architecture"] == "mlp" or model["name_or_path"]:
        return
    from jobspec.model.build import build_config, loading_error

    try:
        build_config(resolved.spec)
    except SpecError as err:
        raise resolved.locate(err) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise resolved.locate(loading_error(model, model["task"], model["attention"],
                                            err)) from None


def lora_target_check(resolved: ResolvedSpec) -> None:
    """`model.lora`'s target patterns and `modules_to_save` against the model's real module names,
    on the meta device (validate cannot know them without building the model): refused, positioned,
    before anything is derived or launched."""
    spec = resolved.spec
    if spec["model"]["lora"] is None:
        return
    from jobspec.model.build import build_skeleton
    from jobspec.model.lora import check_targets

    # transformers' log lines to the command's log (plan, compile)
    library_log.adopt_transformers()
    try:
        try:
            model = build_skeleton(spec)
        except SpecError as err:
            if spec["model"]["name_or_path"] \
                    and all(i.path == ("model", "name_or_path") for i in err.issues):
                # a hub id this machine cannot read (offline, say): `compile` still works as without
                # LoRA; a launch refuses it before any rank (job/model_config via job/checks), and
                # the ranks' `lora` patch checks the patterns against the loaded model all the same
                return
            raise
        check_targets(spec, model)
    except SpecError as err:
        raise resolved.locate(err) from None


def checks_key(spec: JobSpec) -> str | None:
    """The plan cache's key of the mark that this spec's checks passed: the spec's relevant part
    with the local files they read (a checkpoint's directory, the tokenizer's, the record files,
    the chat template) and the environment; None when the model or the tokenizer is a hub id."""
    files: dict[str, object] = {}
    names = (("model", spec["model"]["name_or_path"]), ("tokenizer", tokenizer_name(spec)))
    for what, name in names:
        if name:
            if not Path(name).exists():
                return None
            files[what] = path_state(name)
    for field in ("train", "eval", "chat_template"):
        value = spec["data"].get(field)
        if isinstance(value, str):   # a directory or a dataset by name: no check reads it
            files[field] = path_state(value) if Path(value).is_file() else value
    return spec_digest(spec, checks=files)


def checks_passed(spec: JobSpec) -> bool:
    """Whether `record_checks` marked this spec, its files and this environment as checked."""
    key = checks_key(spec)
    return key is not None and read_entry(_mark_path(key)) == {"key": key}


def record_checks(spec: JobSpec) -> None:
    """Mark the spec checked: model_data_checks (with `plan`) and lora_target_check passed."""
    key = checks_key(spec)
    if key is not None:
        write_entry(_mark_path(key), {"key": key})


def _mark_path(key: str) -> Path:
    from jobspec.model.planner_trace import default_cache_dir

    return default_cache_dir() / "plans" / "checks" / f"{key}.json"
