"""`model.lora`: PEFT's adapters on the patched model (train/lora_adapters.lora on the ranks,
model/lora.apply_lora in the planner's trace), after every patch of the base and before
torch.compile, which must see them.

Its rules, with `model.quantization`'s and `export.adapter`'s, are the static ones (`jobspec
validate`): the spec and the installed packages' presence (importlib.util.find_spec, nothing
imported). What needs the model itself (a target pattern matching no module) is checked where the
model is built on the meta device, on the job-preparation path (job/checks.lora_target_check from
job/prepare.py); whether bitsandbytes' backend can quantise is tried by `jobspec launch` (and
`--dry-run`) before any rank starts, where the ranks run on this host's CPU
(launch/pipeline.quantization_check), and by each rank (model/build); QLoRA under ZeRO-3 is
techniques/quantization's.

Rule codes:
  quantization-needs-lora     a quantised base is frozen, so only adapters can be trained
  quantization-4bit-field     `quant_type` / `double_quant` written for 8-bit weights
  quantization-package        bitsandbytes is not installed
  quantization-architecture   jobspec's own MLP is not a transformers model: transformers cannot
                              quantise it
  lora-freeze                 `model.freeze` beside LoRA: the base is frozen already
  export-adapter              `export.adapter` written for a job without LoRA
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from jobspec import tasks
from jobspec.errors import SpecIssue
from jobspec.spec.rules.base import get
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique

if TYPE_CHECKING:
    from jobspec.spec.validation import ResolvedSpec


def random_base_note(spec: JobSpec) -> str | None:
    """The note for LoRA on a model built from its config (no `model.name_or_path`): its base
    weights are random, and frozen, so the adapters learn on noise; said by validate, plan and the
    launch header, as the examples do it on purpose (a pipeline tried without a download)."""
    model = spec["model"]
    if model["lora"] is None or model["name_or_path"]:
        return None
    return (f"model.lora on a {model['architecture']} built from model.config: the adapters train "
            "on a frozen base of random weights (set model.name_or_path to adapt a pretrained "
            "model)")


def lora_issues(r: ResolvedSpec) -> list[SpecIssue]:
    """Every problem of the LoRA / quantisation fields of a defaults-filled spec, positioned."""
    model = r.spec["model"]
    lora, quant = model["lora"], model["quantization"]
    issues: list[SpecIssue] = []
    if quant is not None:
        here = ("model", "quantization")
        if lora is None:
            issues.append(r.issue(here,
                                  f"a {quant['bits']}-bit base is frozen: without model.lora "
                                  "nothing would be trained",
                                  "add `model.lora: {}` (LoRA on every linear layer), or remove "
                                  "model.quantization", code="quantization-needs-lora"))
        if quant["bits"] == 8:
            # a resolved spec (resolved.yaml, an MLflow run's spec) writes every default: only a
            # value other than the default says something bits 8 cannot honour
            for key, default in (("quant_type", "nf4"), ("double_quant", True)):
                if here + (key,) in r.positions and get(r.spec, here + (key,)) != default:
                    issues.append(r.issue(here + (key,),
                                          f"`{key}` applies to 4-bit weights; bits is 8",
                                          f"remove `{key}`, or set `bits: 4`",
                                          code="quantization-4bit-field"))
        if importlib.util.find_spec("bitsandbytes") is None:
            issues.append(r.issue(here,
                                  "quantised weights need the bitsandbytes package, which is not "
                                  "installed",
                                  "`pip install bitsandbytes`, or remove model.quantization",
                                  code="quantization-package"))
        if model["architecture"] == "mlp" and not model["name_or_path"]:
            issues.append(r.issue(here,
                                  "jobspec's built-in mlp is not a transformers model: "
                                  "transformers' bitsandbytes loading cannot quantise it",
                                  "remove model.quantization, or "
                                  "use a transformers architecture",
                                  code="quantization-architecture"))
    if lora is not None and model["freeze"]:
        issues.append(r.issue(("model", "freeze"),
                              "with model.lora the base model is frozen already; only the "
                              "adapters and `modules_to_save` are trained",
                              "remove model.freeze (to train fewer modules, narrow "
                              "model.lora.target_modules)",
                              code="lora-freeze"))
    if lora is None and ("export", "adapter") in r.positions \
            and r.spec["export"]["adapter"] != "both":
        issues.append(r.issue(("export", "adapter"),
                              "export.adapter chooses between a merged model and a LoRA "
                              "adapter, and this job has no model.lora",
                              "remove export.adapter, or add model.lora", code="export-adapter"))
    return issues


def lora_patch_args(spec: JobSpec) -> dict:
    """`model.lora` as the `lora` patch gives it to PEFT's LoraConfig (model/lora.adapt): the
    loader's defaults filled, `modules_to_save` resolved (null: the task's head modules, each kept
    where the model has it: the head's name depends on the architecture). The target patterns stay
    as written (`all-linear` is PEFT's own keyword): they are matched against the built model's
    module names, which this pure step cannot see (job/checks refuses a pattern matching nothing
    before launch)."""
    lora = spec["model"]["lora"]
    assert lora is not None, "lora_patch_args needs model.lora"
    target = lora["target_modules"]
    saved = lora["modules_to_save"]
    return {"r": lora["r"], "alpha": lora["alpha"], "dropout": lora["dropout"],
            "target_modules": target if isinstance(target, str) else list(target),
            "modules_to_save": list(tasks.get(spec["model"]["task"]).head_modules if saved is None
                                    else saved),
            "bias": lora["bias"], "use_rslora": lora["use_rslora"], "use_dora": lora["use_dora"]}


def _args(spec: JobSpec) -> dict | None:
    if not spec["model"]["lora"]:
        return None
    return {**lora_patch_args(spec),
            "enable_input_require_grads": bool(spec["memory"]["activation_checkpointing"])}


def _text(args: dict) -> str:
    target = args.get("target_modules")
    variants = [v for v, on in (("rsLoRA", args.get("use_rslora")), ("DoRA", args.get("use_dora")))
                if on]
    return (f"LoRA r {args.get('r')} alpha {args.get('alpha')} on "
            f"{target if isinstance(target, str) else ', '.join(target or [])}"
            + "".join(f" {v}" for v in variants))


TECHNIQUE = Technique(
    name="lora", summary="PEFT's low-rank adapters trained on a frozen base (`model.lora`)",
    args=_args, text=_text, apply="jobspec.train.lora_adapters:lora",
    trace="jobspec.model.lora:trace_lora", after_base=True,
    rules=(lora_issues,))
