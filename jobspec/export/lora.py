"""Exports of a LoRA job (spec `model.lora`, `export.adapter`): the merged model and the PEFT
adapter.

    <export dir>/<name>            merged: the adapters merged into the base (`from_pretrained`)
    <export dir>/<name>-adapter    the PEFT adapter (adapter_config.json, adapter_model.safetensors)
                                   and the tokenizer: `PeftModel.from_pretrained(base, dir)`
    `jobspec export --out DIR`     the merged model in DIR, the adapter in DIR/adapter (only the
                                   adapter: in DIR), so --out holds all it writes

Both come from one gathered state dict of the PEFT-wrapped model (the worker's export under any
ZeRO stage, or `jobspec export` from a checkpoint). It goes into the spec's model built on the meta
device and wrapped by the same `model/lora.apply_lora` the ranks used, after a check of its tensors'
count and shapes against that model: ZeRO-3 gathers a partitioned parameter as a flat or empty
tensor when it goes wrong (the peers' "adapter saved empty" reports), and that must fail the export,
not write an adapter of zeros. A QLoRA base is dequantised first (model/quantize.py), so the merged
model is the dequantised base plus the adapters: what the job trained.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from jobspec.errors import RunFailure
from jobspec.export.hf_dir import dir_bytes, torch_dtype
from jobspec.spec.types import JobSpec

ADAPTER_SUFFIX = "-adapter"
EXPORT_ADAPTER_DIR = "adapter"   # `jobspec export --out DIR`: DIR/adapter, inside the merged model
BASE_DIR = "base"   # inside the adapter directory: the base of a model built from a config


class GatherMismatch(RunFailure):
    """The gathered weights are not the model's: missing, unexpected or wrongly shaped tensors."""


def wanted(spec: JobSpec) -> tuple[bool, bool]:
    """(merged, adapter): what `export.adapter` asks for; without model.lora, the merged (plain)
    model only."""
    if not spec["model"]["lora"]:
        return True, False
    choice = spec["export"]["adapter"]
    return choice in ("merged", "both"), choice in ("adapter", "both")


def peft_skeleton(spec: JobSpec, tokenizer=None):
    """The spec's model on the meta device, wrapped with the job's adapters (no weights
    anywhere)."""
    import torch

    from jobspec.model.build import build_skeleton
    from jobspec.model.lora import apply_lora

    base = build_skeleton(spec, tokenizer)
    with torch.device("meta"):
        return apply_lora(base, spec)


def check_gathered(model, state_dict: dict, source: str) -> int:
    """The gathered tensors against `model`'s state dict: same names, same count, same shapes.
    Returns the count; raises GatherMismatch saying what differs."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(getattr(v, "shape", ())) for k, v in state_dict.items()}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing or unexpected or wrong:
        parts = [f"{len(found)} tensors gathered, the model has {len(expected)}"]
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:3])}")
        if wrong:
            parts.append("wrong shapes "
                         + ", ".join(f"{k} {found[k]} (model {expected[k]})" for k in wrong[:3]))
        raise GatherMismatch(f"the weights gathered from {source} do not match the model: "
                             + "; ".join(parts))
    return len(expected)


def split(spec: JobSpec, state_dict: dict, dtype: str, source: str, tokenizer=None):
    """(the PEFT model holding the gathered weights cast to `dtype`, the tensor count). Consumes
    `state_dict`."""
    model = peft_skeleton(spec, tokenizer)
    count = check_gathered(model, state_dict, source)
    target = torch_dtype(dtype)
    converted: dict = {}   # tied weights stay one tensor
    for key in list(state_dict):
        value = state_dict[key]
        if id(value) not in converted:
            tensor = value.contiguous()   # a ZeRO-3 GatheredTensor is assembled here
            # a copy: under ZeRO 0-2 these are the engine's own parameters, and merge_and_unload
            # adds the adapters into the base weights in place
            converted[id(value)] = tensor.to(target, copy=True) if tensor.is_floating_point() \
                else tensor.clone()
        state_dict[key] = converted[id(value)]
    model.load_state_dict(state_dict, strict=True, assign=True)
    state_dict.clear()
    if hasattr(model.base_model.model, "tie_weights"):
        model.base_model.model.tie_weights()
    return model, count


def merged_state_dict(peft_model) -> dict:
    """The adapters merged into the base (peft's merge_and_unload): a plain model's state dict."""
    return peft_model.merge_and_unload(progressbar=False).state_dict()


def base_state_dict(peft_model) -> dict:
    """The frozen base's weights under the plain model's names (the adapters left out): what the
    adapter goes onto. PEFT names a wrapped layer's own weight `<layer>.base_layer.weight` and a
    `modules_to_save` copy's original `<module>.original_module.weight`."""
    base = {}
    for key, value in peft_model.state_dict().items():
        if ".lora_" in key or ".modules_to_save." in key or "lora_magnitude_vector" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.",
                                                             ".").replace(".original_module.", ".")
        base[name] = value
    return base


def base_readme(base: str, built: bool) -> str:
    """The adapter README's section on its base: where it is and how to load the pair."""
    where = ("The base is the job's model built from its config with random weights (no hub id "
             "names it): its exact weights, as trained on (frozen), are exported beside the "
             f"adapter in `{BASE_DIR}/` ({base}).") if built else f"The base model is `{base}`."
    return ("\n## Base model\n\n" + where + "\n\n```python\nfrom peft import PeftModel\n"
            "from transformers import AutoModelForCausalLM\n\n"
            f'base = AutoModelForCausalLM.from_pretrained("{base}")\n'
            'model = PeftModel.from_pretrained(base, "ADAPTER_DIR")\n```\n')


def write_adapter_dir(out: str | os.PathLike, spec: JobSpec, peft_model, info: dict, tokenizer=None,
                      final: Path | None = None) -> dict:
    """PEFT's own `save_pretrained` (adapter weights and adapter_config.json) and the job's
    tokenizer (`tokenizer`, when it has one) into `out`, built under a temporary name and renamed
    into place; returns its record. A base built from a config (no `model.name_or_path` names it)
    is exported into `out/base` (export/hf_dir.py, with the tokenizer) and adapter_config.json's
    `base_model_name_or_path` names that directory: no other copy of the frozen random weights
    exists (under ZeRO-3 they are not even the seed's whole-model init). `final`: where the caller
    moves the directory afterwards (the base's path names it there); default `out`."""
    from jobspec.export.hf_dir import ExportInfo, follow_umask, with_job_template, write_model_dir

    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    started = time.monotonic()
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        named = spec["model"]["name_or_path"]
        base = named or str(((final or out) / BASE_DIR).resolve())
        if not named:   # before save_pretrained: PEFT's model card names the base too
            base_spec: JobSpec = {**spec,
                                  "model": {**spec["model"], "lora": None, "quantization": None}}
            write_model_dir(tmp / BASE_DIR, base_spec, base_state_dict(peft_model),
                            ExportInfo(name=f"{info.get('name')} base", step=info.get("step"),
                                       dtype=info.get("dtype", "fp32"),
                                       source="the frozen base the adapter trained on",
                                       metrics={}, notes=[]), tokenizer=tokenizer)
        peft_model.save_pretrained(tmp)
        if tokenizer is not None:   # AutoTokenizer.from_pretrained(adapter dir), as the merged one
            with_job_template(spec, tokenizer)
            tokenizer.save_pretrained(tmp)
        config_path = tmp / "adapter_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["base_model_name_or_path"] = base
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        readme = tmp / "README.md"
        card = readme.read_text(encoding="utf-8") if readme.is_file() \
            else f"# {spec['name']} adapter\n"
        readme.write_text(card.rstrip("\n") + "\n" + base_readme(base, not named), encoding="utf-8")
        record = {**info, "job": spec["name"], "kind": "peft-adapter"}
        (tmp / "jobspec_export.json").write_text(json.dumps(record, indent=2) + "\n",
                                                 encoding="utf-8")
        follow_umask(tmp)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**record, "path": str(out), "bytes": dir_bytes(out),
            "seconds": round(time.monotonic() - started, 3)}
