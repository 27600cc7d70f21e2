"""The model and data refusals `plan`, `compile` and `launch` (dry or not) make before anything is derived.

One function, `model_data_checks(resolved)`, run by job/prepare.prepare_job on every path
(`jobspec plan`, `jobspec compile`, `jobspec launch` and `--dry-run`, `jobspec prepare`), so none of
them can plan, compile or start a model other than the one written. What it adds to validate's
rules is what needs transformers or the network (validate imports neither):

- `model.config` of a hub id (its config.json names the type) or of a type the generated table
  lacks: job/model_config, with the positioned errors validate gives;
- the config transformers builds from it, refused at the keys involved (model/build.build_config:
  `pad_token_id` beyond `vocab_size`, ...), never as a later failure of another field;
- `model.attention` left out for a hub id: the best the head supports, now that its type is known;
- (the records' shape: validate, data/datacheck.record_issues, every bad record at its file:line)
- the tokenizer transformers loads, its size against the vocabulary, the chat template rendered on
  the records (data/data_preflight).

`lora_target_check`, run by prepare_job whether or not the other checks are: `model.lora`'s target
patterns against the meta-built model (model/lora.check_targets).
What only a launch checks is the host's (port, GPUs, disk, lease, bitsandbytes' CPU backend):
launch/pipeline.launch_checks and host_checks, and tests/test_refusals.py says so per site.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from jobspec import library_log
from jobspec.data import data_preflight
from jobspec.errors import SpecError
from jobspec.job.model_config import job_model_config_issues

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def model_data_checks(resolved: ResolvedSpec, plan: bool = True) -> None:
    """Raise SpecError (positioned) for the first group of problems found. `plan`: the model will be
    built (plan, launch): the config transformers builds is checked first, at the config keys.
    `jobspec compile` (no plan) leaves that one out: AutoConfig imports torch (~8 s), compile stays
    light, and validate has checked every key, type and the padding id against the generated table."""
    for warning in resolved.warnings:   # validate's, said by plan, compile and launch too
        print(f"jobspec: warning: {warning.render()}", file=sys.stderr)
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
        raise resolved.locate(loading_error(model, model["task"], model["attention"], err)) from None


def lora_target_check(resolved: ResolvedSpec) -> None:
    """`model.lora`'s target patterns and `modules_to_save` against the model's real module names, on the
    meta device (validate cannot know them without building the model): refused, positioned, before
    anything is derived or launched."""
    spec = resolved.spec
    if spec["model"]["lora"] is None:
        return
    from jobspec.model.build import build_skeleton
    from jobspec.model.lora import check_targets

    library_log.adopt_transformers()   # transformers' log lines to the command's log (plan, compile)
    try:
        try:
            model = build_skeleton(spec)
        except SpecError as err:
            if spec["model"]["name_or_path"] and all(i.path == ("model", "name_or_path") for i in err.issues):
                # a hub id this machine cannot read (offline, say): `compile` still works as without LoRA; a
                # launch refuses it before any rank (job/model_config via job/checks), and the ranks' `lora`
                # patch checks the patterns against the loaded model all the same
                return
            raise
        check_targets(spec, model)
    except SpecError as err:
        raise resolved.locate(err) from None
