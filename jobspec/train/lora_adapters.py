"""LoRA / QLoRA on the ranks (spec `model.lora`, `model.quantization`): the `lora` patch that puts
PEFT's adapters on the model, and the parameter counts (model/lora.parameter_counts) the closing
summary and MLflow record.

Order on a rank (train/engine.build_engine): the model is built (quantised by model/build when
`model.quantization` is set: bitsandbytes replaces whole weights, so before anything else sees
them), then patches.json's patches run in the compiler's order (attention, checkpointing, freeze,
..., `lora`, torch.compile), then `deepspeed.initialize` gets only the trainable parameters.
"""
from __future__ import annotations

from jobspec.model.lora import parameter_counts
from jobspec.spec.types import JobSpec


def lora(model, *, enable_input_require_grads: bool = False, **settings):
    """The `lora` patch: (the PEFT-wrapped model, a note), `settings` as the compiler writes them
    (techniques/lora.lora_patch_args) given to model/lora.adapt, the call the planner's trace and
    the export make too. With activation checkpointing and a frozen base the first layer's inputs
    carry no gradient, so a reentrant checkpoint would cut the adapters off from backward (and the
    non-reentrant one warns): `enable_input_require_grads` (the compiler sets it with checkpointing)
    makes the embeddings' output require grad, through transformers', as PEFT's
    `prepare_model_for_kbit_training` does."""
    from jobspec.model.lora import adapt

    if enable_input_require_grads and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    model = adapt(model, settings)
    return model, (f"LoRA: r={settings['r']} alpha={settings['alpha']} "
                   f"dropout={settings['dropout']} target_modules={settings['target_modules']}: "
                   f"{fmt_counts(parameter_counts(model))}")


def fmt_counts(counts: dict) -> str:
    total = counts["total"] or 1
    share = 100 * counts["trainable"] / total
    return f"{counts['trainable']:,} trainable of {counts['total']:,} parameters ({share:.2f}%)"


def params_for_mlflow(spec: JobSpec, counts: dict) -> dict:
    """The MLflow params a rank adds to the launch's (the flattened spec has model.lora.*
    already)."""
    params = {"params.trainable": counts["trainable"], "params.total": counts["total"]}
    lora = spec["model"]["lora"]
    if lora:
        params["lora.summary"] = (f"r={lora['r']} alpha={lora['alpha']} dropout={lora['dropout']} "
                                  f"rslora={lora['use_rslora']} dora={lora['use_dora']}")
    quant = spec["model"]["quantization"]
    if quant:
        params["quantization.summary"] = f"{quant['bits']}-bit {quant['quant_type']}"
    return params
