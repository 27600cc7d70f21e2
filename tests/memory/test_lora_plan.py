"""The planner with `model.lora` / `model.quantization`: the trace wraps the model with model/lora.apply_lora
(the ranks' call), so its inventory holds exactly PEFT's adapters; the frozen base has no gradients or
optimizer states; bitsandbytes' 4-bit / 8-bit weights are counted as bitsandbytes stores them (checked
against its own quantisation of the model's weights on this CPU); `--fit` of a LoRA job."""
from __future__ import annotations

import math

import pytest

from jobspec.memory.fit import fit
from jobspec.memory.planner import plan_memory, weight_bytes
from jobspec.model.build import build_skeleton
from jobspec.model.lora import apply_lora, parameter_counts
from jobspec.model.planner_trace import job_profiler
from jobspec.spec.derived import derive
from jobspec.spec.schema import fill_defaults

PROFILER = job_profiler()
LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512}


def llama_spec(lora=None, quantization=None, **memory) -> dict:
    model = {"architecture": "llama", "task": "causal-lm", "config": LLAMA}
    if lora is not None:
        model["lora"] = lora
    if quantization is not None:
        model["quantization"] = quantization
    return fill_defaults({"model": model, "data": {"synthetic": {"seq_len": 64, "vocab_range": [0, 512]}},
                          "training": {"max_steps": 2, "micro_batch_size": 4},
                          "memory": {"precision": "bf16", **memory}})


def planned(spec: dict):
    job = derive(spec, profiler=PROFILER)
    return job, plan_memory(spec, job)


def test_the_inventory_holds_exactly_the_adapters_peft_makes():
    spec = llama_spec({"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    job, plan = planned(spec)
    wrapped = apply_lora(build_skeleton(spec), spec)
    counts = parameter_counts(wrapped)
    trainable, total = counts["trainable"], counts["total"]
    inventory = job.profile.inventory
    assert (inventory.trainable, inventory.total) == (trainable, total)
    assert plan.settings["trainable_parameters"] == trainable


def test_the_frozen_base_has_no_gradients_and_no_optimizer_states():
    _, full = planned(llama_spec())
    job, lora = planned(llama_spec({"r": 8}))
    trainable = job.profile.inventory.trainable
    assert lora.breakdown["gradients"] == 2 * trainable              # bf16, ZeRO-0
    assert lora.breakdown["optimizer_states"] == 8 * trainable       # AdamW's two fp32 moments
    assert lora.breakdown["master_weights"] == 4 * trainable
    assert lora.breakdown["parameters"] == 2 * job.profile.inventory.total
    assert lora.model_states < full.model_states / 2


@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_weights_are_counted_as_bitsandbytes_stores_them(double_quant):
    import bitsandbytes.functional as bnbf
    import torch

    spec = llama_spec({}, {"bits": 4, "double_quant": double_quant})
    job, plan = planned(spec)
    inventory = job.profile.inventory
    shapes = inventory.quantized_shapes()
    assert len(shapes) == 7 * 3   # q, k, v, o, gate, up, down in 3 layers; embeddings and lm_head stay bf16
    stored = 0
    for shape in shapes:   # bitsandbytes' own quantisation of a weight that shape, on this CPU
        packed, state = bnbf.quantize_4bit(torch.randn(shape, dtype=torch.bfloat16), blocksize=64,
                                           compress_statistics=double_quant, quant_type="nf4")
        tensors = [packed, state.absmax, state.code]
        if state.nested:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
        stored += sum(t.numel() * t.element_size() for t in tensors)
    unquantized = sum(math.prod(s) for s in shapes)
    assert weight_bytes(inventory, 2, spec["model"]["quantization"]) == 2 * (inventory.total - unquantized) + stored
    assert plan.breakdown["parameters"] == 2 * (inventory.total - unquantized) + stored
    assert plan.breakdown["dequantized_weight"] == 2 * max(math.prod(s) for s in shapes)


def test_8bit_weights_are_an_int8_copy_and_a_scale_per_row():
    spec = llama_spec({}, {"bits": 8})
    job, plan = planned(spec)
    inventory = job.profile.inventory
    shapes = inventory.quantized_shapes()
    unquantized = sum(math.prod(s) for s in shapes)
    assert plan.breakdown["parameters"] == 2 * (inventory.total - unquantized) + unquantized + \
        sum(4 * s[0] for s in shapes)


def test_fit_of_a_lora_job_changes_micro_batch_or_checkpointing_not_the_quantised_layout():
    spec = llama_spec({}, {"bits": 4})
    job, plan = planned(spec)
    budget = plan.nvml_total - plan.breakdown["activations"] // 2   # the activations must shrink
    result = fit(spec, job, budget, bf16_supported=True)
    assert result.fits
    assert set(result.changes) & {"training.micro_batch_size", "memory.activation_checkpointing"}
    assert "memory.zero_stage" not in result.changes and "memory.offload.params" not in result.changes


@pytest.mark.parametrize("checkpointing", [False, {"every_n_layers": 2}])
def test_the_composed_trace_of_an_adapted_model_equals_its_full_trace(checkpointing):
    """Unit traces of the cut, PEFT-wrapped model compose to the whole wrapped model's trace."""
    from jobspec.model.planner_trace import ModelTracer

    spec = llama_spec({"r": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]})
    tracer = ModelTracer(spec)
    composed = tracer.profile("bf16", 3, 64, checkpointing)
    assert composed.method == "composed"
    full = tracer.full("bf16", 3, 64, checkpointing)
    assert composed.activations.peak == full.peak and composed.activations.regions == full.regions


def test_adapters_on_some_layers_only_are_traced_whole():
    """Layers that differ in their adapters are not composed from one unit (`Inventory.uniform`)."""
    spec = llama_spec({"r": 8, "target_modules": ["layers.1.mlp.down_proj"]})
    job, _ = planned(spec)
    assert not job.profile.inventory.uniform and job.profile.method == "full"
