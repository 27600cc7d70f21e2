"""FLOPs per token at real model sizes: the planner's trace vs the old 6N formula vs torch's counter.

    python bench/flops_check.py              # every row, on the meta device (shapes only, seconds)
    python bench/flops_check.py --device cpu --only GPT-2   # real tensors, batch 1 (slow at these sizes)

Each row builds the model jobspec trains (jobspec.model.build.build_model, eager attention) from its config,
runs one forward + backward under torch.utils.flop_counter.FlopCounterMode (matrix products only;
on the meta device it counts from the shapes, nothing is computed) and divides by the tokens.
Columns, in GFLOP per trained token: jobspec (jobspec.model.planner_trace: fake tensors, layers composed from
short units; model FLOPs, hardware FLOPs on the checkpointed rows, which the counter sees recomputed), the old formula (6N + 12Lhs, N counting the embeddings, plus
its recompute term), torch, and the ratios to torch.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from jobspec.model.build import build_model  # noqa: E402
from jobspec.model.planner_trace import ModelTracer  # noqa: E402
from jobspec.model.structure import gradient_checkpointing  # noqa: E402
from jobspec.spec.model_dims import model_dims  # noqa: E402
from jobspec.spec.schema import fill_defaults  # noqa: E402

LARGE_ENCODER = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                 "intermediate_size": 4096}
XLMR_LARGE = {**LARGE_ENCODER, "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1}
BERT_LARGE = {**LARGE_ENCODER, "vocab_size": 30522, "max_position_embeddings": 512}
GPT2_SMALL = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
# TinyLlama-1.1B's shape: 32 query heads share 4 KV heads, untied output layer
TINYLLAMA = {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 2048,
             "tie_word_embeddings": False}
EVERY_LAYER = {"every_n_layers": 1, "use_reentrant": False}

# (label, architecture, task, config, seq_len, activation_checkpointing)
ROWS = [
    ("XLM-R large, seq-cls", "xlm-roberta", "sequence-classification", XLMR_LARGE, 512, False),
    ("XLM-R large, MLM", "xlm-roberta", "masked-lm", XLMR_LARGE, 512, False),
    ("BERT-large, seq-cls", "bert", "sequence-classification", BERT_LARGE, 512, False),
    ("BERT-large, MLM", "bert", "masked-lm", BERT_LARGE, 512, False),
    ("GPT-2 124M, causal-lm", "gpt2", "causal-lm", GPT2_SMALL, 1024, False),
    ("TinyLlama 1.1B (GQA), causal-lm", "llama", "causal-lm", TINYLLAMA, 2048, False),
    ("XLM-R large, seq-cls, ckpt every layer", "xlm-roberta", "sequence-classification", XLMR_LARGE, 512,
     EVERY_LAYER),
    ("XLM-R large, seq-cls, ckpt 1 in 2", "xlm-roberta", "sequence-classification", XLMR_LARGE, 512,
     {"every_n_layers": 2, "use_reentrant": False}),
    ("TinyLlama 1.1B, ckpt every layer", "llama", "causal-lm", TINYLLAMA, 2048, EVERY_LAYER),
]
NUM_LABELS = 2


def old_formula(dims, params: int, seq_len: int, checkpointing) -> float:
    """The formula jobspec.train.metrics.flops_per_token used before issue 10 (N: every parameter)."""
    layers, hidden, vocab = dims.num_layers, dims.hidden_size, dims.vocab_size
    flops = 6 * params + 12 * layers * hidden * seq_len
    if checkpointing:
        every = checkpointing.get("every_n_layers", 1) if isinstance(checkpointing, dict) else 1
        recomputed = math.ceil(layers / every) / layers
        flops += recomputed * (2 * (params - vocab * hidden) + 4 * layers * hidden * seq_len)
    return flops


def counted(spec: dict, seq_len: int, device: str) -> float:
    """FlopCounterMode's FLOPs per token of one forward + backward at batch 1."""
    task = spec["model"]["task"]
    with torch.device(device):
        model = build_model(spec)
    checkpointing = spec["memory"]["activation_checkpointing"]
    if checkpointing:
        gradient_checkpointing(model, every_n_layers=checkpointing["every_n_layers"],
                               use_reentrant=checkpointing["use_reentrant"])
    model.train()
    ids = torch.randint(1, model.config.vocab_size, (1, seq_len), device=device)
    labels = torch.zeros(1, dtype=torch.long, device=device) if task == "sequence-classification" else ids
    mask, unpacked = torch.ones_like(ids), contextlib.nullcontext()
    if device == "meta":
        # transformers looks at token values (.item()) for padding and packed sequences, which meta
        # tensors cannot answer; a batch of one unpadded sequence has neither, so tell it so: no mask,
        # no pad id for an LM, not packed. The attention mask is then built from the shapes only.
        mask = None
        if task != "sequence-classification":
            model.config.pad_token_id = None
        unpacked = mock.patch("transformers.masking_utils.find_packed_sequence_indices", return_value=None)
    with unpacked, FlopCounterMode(display=False) as counter:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return counter.get_total_flops() / seq_len


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="meta", help="meta (default: shapes only) or cpu")
    parser.add_argument("--only", metavar="TEXT", help="only the rows whose label contains TEXT")
    args = parser.parse_args(argv)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}, "
          f"batch 1, eager attention; GFLOP per trained token (forward + backward)\n")
    print("| model | seq | jobspec | old formula | torch FlopCounterMode | jobspec / torch | old / torch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, architecture, task, config, seq_len, checkpointing in ROWS:
        if args.only and args.only not in label:
            continue
        spec = fill_defaults({"model": {"architecture": architecture, "task": task, "num_labels": NUM_LABELS,
                                        "config": dict(config), "attention": "eager"},
                              "memory": {"activation_checkpointing": checkpointing}, "training": {"seed": 0}})
        tracer = ModelTracer(spec)
        profile = tracer.profile("fp32", 1, seq_len, checkpointing)
        ours = profile.hardware_flops_per_token if checkpointing else profile.model_flops_per_token
        old = old_formula(model_dims(spec), tracer.inventory().total, seq_len, checkpointing)
        torch_flops = counted(spec, seq_len, args.device)
        print(f"| {label} | {seq_len} | {ours / 1e9:.3f} | {old / 1e9:.3f} | {torch_flops / 1e9:.3f} | "
              f"{ours / torch_flops:.4f} | {old / torch_flops:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
