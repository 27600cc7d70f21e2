"""`model.lora`: PEFT's adapters on the patched model (train/lora_adapters.lora on the ranks,
model/lora.apply_lora in the planner's trace), after every patch of the base and before
torch.compile, which must see them. Its rules (with `model.quantization`'s and `export.adapter`'s):
spec/rules/lora.py."""
from __future__ import annotations

from jobspec import tasks
from jobspec.spec.rules import lora as lora_rules
from jobspec.spec.types import JobSpec
from jobspec.techniques.base import Technique


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
    args=_args, text=_text, apply="jobspec.train.lora_adapters:lora", after_base=True,
    rules=(lora_rules.lora_issues,))
