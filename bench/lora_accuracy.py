"""Planner accuracy for `model.lora` / `model.quantization` on a CPU (no GPU needed):

    python bench/lora_accuracy.py          # ~3 min on 2 cores
    python bench/lora_accuracy.py --quick  # the model-state rows only (seconds)

1. Model states, real tensors: a Llama-architecture model (random weights, saved and loaded back as
   the ranks load it) through transformers' bitsandbytes loading (`quantization_config`, the CPU
   backend of bitsandbytes 0.49 runs 4-bit and 8-bit here) and `apply_lora`, one forward + backward.
   Measured: the bytes of every parameter storage (the packed 4-bit / int8 weights and bitsandbytes'
   quantisation constants: absmax, codes, nested absmax, offset, int8 row scales), the trainable
   parameters and their gradients. Planned: the planner's `parameters` and `gradients` rows (bf16,
   ZeRO-0); the adapters are cast to bf16 as DeepSpeed's bf16 engine casts the module.
2. Activations: the planner's composed trace of a LoRA model against torch's MemTracker over one
   forward + backward of the whole PEFT-wrapped model on fake tensors (planner_accuracy.memtracker_peak,
   which wraps the model with the same `apply_lora`).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobspec.spec.schema import fill_defaults  # noqa: E402
from jobspec.units import MiB  # noqa: E402

LLAMA = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 4000, "max_position_embeddings": 512,
         "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# (label, model.lora, model.quantization)
STATE_ROWS = [
    ("LoRA r 16 all-linear, bf16 base", {"r": 16}, None),
    ("LoRA r 8 q/v, bf16 base", {"r": 8, "target_modules": ["q_proj", "v_proj"]}, None),
    ("QLoRA 4-bit NF4, double quant", {"r": 16}, {"bits": 4, "quant_type": "nf4", "double_quant": True}),
    ("QLoRA 4-bit FP4, no double quant", {"r": 16}, {"bits": 4, "quant_type": "fp4", "double_quant": False}),
    ("LoRA on an 8-bit base (LLM.int8)", {"r": 16}, {"bits": 8}),
]
# (memtracker model, layers, attention, precision, micro, seq, checkpointing, model.lora)
ACTIVATION_ROWS = [
    ("llama-3-8B", 4, "sdpa", "bf16", 1, 2048, True, {"r": 16}),
    ("llama-3-8B", 4, "sdpa", "bf16", 2, 1024, False, {"r": 16, "target_modules": ["q_proj", "v_proj"]}),
    ("qwen2.5-0.5B", 8, "sdpa", "bf16", 4, 1024, False, {"r": 16, "target_modules": ["q_proj", "k_proj",
                                                                                   "v_proj", "o_proj"]}),
    ("xlmr-base", None, "sdpa", "fp32", 16, 128, False, {"r": 8, "target_modules": ["query", "value"]}),
]


def lora_spec(lora: dict, quantization: dict | None, config: dict = LLAMA, architecture: str = "llama",
              task: str = "causal-lm", precision: str = "bf16", micro: int = 2, seq: int = 64) -> dict:
    model = {"architecture": architecture, "task": task, "config": config, "lora": lora}
    if quantization is not None:
        model["quantization"] = {"compute_dtype": "auto", **quantization}
    return fill_defaults({"model": model, "data": {"synthetic": {"seq_len": seq, "vocab_range": [3, 4000]}},
                          "training": {"max_steps": 1, "micro_batch_size": micro},
                          "memory": {"precision": precision}, "logging": {"mlflow": {"enabled": False}}})


def measured_states(spec: dict) -> dict:
    """Bytes of the parameters as loaded (quantisation constants included), trainable count, gradient bytes."""
    import torch

    from jobspec.model.build import build_config, build_skeleton
    from jobspec.model.lora import apply_lora, quantization_config

    auto_class, config = build_config(spec)
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        auto_class.from_config(config).save_pretrained(directory)
        quant = quantization_config(spec, build_skeleton(spec))
        model = auto_class.from_pretrained(directory, dtype=torch.bfloat16, device_map="cpu",
                                           **({"quantization_config": quant} if quant is not None else {}))
    model = apply_lora(model, spec)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)   # DeepSpeed's bf16 engine casts the trained module
    seen: set[int] = set()
    storage = 0

    def count(tensor) -> None:
        nonlocal storage
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            storage += tensor.numel() * tensor.element_size()

    for module in model.modules():
        for param in module.parameters(recurse=False):
            count(param)
            state = getattr(param, "quant_state", None)   # Params4bit
            if state is not None:
                for tensor in (state.absmax, state.code, *((state.state2.absmax, state.state2.code, state.offset)
                                                           if state.nested else ())):
                    count(tensor)
            count(getattr(param, "SCB", None))              # Int8Params: an fp32 scale per output row
    ids = torch.randint(3, 4000, (spec["training"]["micro_batch_size"], spec["data"]["synthetic"]["seq_len"]))
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"parameters": storage, "trainable": sum(p.numel() for p in trainable),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)}


def state_rows() -> list[dict]:
    from jobspec.memory.planner import plan_memory
    from jobspec.model.planner_trace import job_profiler
    from jobspec.spec.derived import derive

    profiler, rows = job_profiler(), []
    for label, lora, quantization in STATE_ROWS:
        spec = lora_spec(lora, quantization)
        plan = plan_memory(spec, derive(spec, profiler=profiler))
        measured = measured_states(spec)
        rows.append({"label": label, "planned": plan.breakdown["parameters"], "measured": measured["parameters"],
                     "trainable_planned": plan.settings["trainable_parameters"],
                     "trainable": measured["trainable"], "gradients_planned": plan.breakdown["gradients"],
                     "gradients": measured["gradients"]})
    return rows


def activation_rows() -> list[dict]:
    from bench.planner_accuracy import MT_MODELS, memtracker_peak, mt_spec
    from jobspec.model.planner_trace import ModelTracer

    rows = []
    for model, layers, attention, precision, micro, seq, ckpt, lora in ACTIVATION_ROWS:
        spec = mt_spec(model, layers, attention)
        spec["model"]["lora"] = fill_defaults({"model": {"lora": lora}})["model"]["lora"]
        planned = ModelTracer(spec).profile(precision, micro, seq, ckpt).activations.peak
        reference = memtracker_peak(spec, precision, micro, seq, ckpt)["activations"]
        total = MT_MODELS[model][2].get("num_hidden_layers")
        stack = f" ({layers} of {total} layers)" if layers else ""
        targets = lora.get("target_modules", "all-linear")
        rows.append({"label": f"{model}{stack}, {precision}, {micro} x {seq}, ckpt {'on' if ckpt else 'off'}, "
                              f"LoRA r {lora['r']} {targets if isinstance(targets, str) else '/'.join(targets)}",
                     "planned": planned, "measured": reference})
        print(f"lora_accuracy: {rows[-1]['label']}", file=sys.stderr, flush=True)
    return rows


def run(quick: bool = False) -> int:
    from bench.planner_accuracy import table

    rows = state_rows()
    table([(r["label"], f"{r['planned'] / MiB:.2f}", f"{r['measured'] / MiB:.2f}",
            f"{100 * (r['planned'] / r['measured'] - 1):+.2f}%", f"{r['trainable_planned']:,}", f"{r['trainable']:,}",
            f"{r['gradients_planned'] / MiB:.2f}", f"{r['gradients'] / MiB:.2f}") for r in rows],
          ["model states (Llama 4 x 512, real tensors, CPU)", "planned parameters MiB", "measured MiB", "error",
           "planned trainable", "measured trainable", "planned gradients MiB", "measured MiB"])
    states_worst = worst = max(abs(r["planned"] / r["measured"] - 1) for r in rows)
    exact = all(r["trainable_planned"] == r["trainable"] and r["gradients_planned"] == r["gradients"] for r in rows)
    if not quick:
        acts = activation_rows()
        print()
        table([(r["label"], f"{r['planned'] / MiB:.1f}", f"{r['measured'] / MiB:.1f}",
                f"{100 * (r['planned'] / r['measured'] - 1):+.2f}%") for r in acts],
              ["activations (fake tensors)", "planner MiB", "MemTracker MiB", "error"])
        errors = [abs(r["planned"] / r["measured"] - 1) for r in acts]
        print(f"\nactivations: median |error| {100 * statistics.median(errors):.2f}%, max {100 * max(errors):.2f}%")
        worst = max(worst, max(errors))
    print(f"model states: max |error| of the parameters {100 * states_worst:.2f}%; trainable and gradients "
          f"{'exact' if exact else 'DIFFER'}")
    return 0 if exact and worst <= 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(run("--quick" in sys.argv))
