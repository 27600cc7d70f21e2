"""Planner accuracy on a CUDA GPU: predicted vs measured `torch.cuda.max_memory_allocated`.

    python bench/planner_accuracy.py            # on a CUDA machine: runs every row (1 GPU)
    python bench/planner_accuracy.py --dry-run  # predictions only (any machine)
    python bench/planner_accuracy.py --guide    # planner next to the HF single-GPU guide's 9 bert-large rows
    python bench/planner_accuracy.py --seeds    # planner totals next to seed 000's XLM-R rows (CPU, ~1 min)
    python bench/planner_accuracy.py --memtracker  # planner activations vs torch's MemTracker (CPU, ~2.5 min)
    python bench/planner_accuracy.py --json OUT # also the rows as JSON (`python -m bench gpu` reads it)
    python bench/lora_accuracy.py               # LoRA / QLoRA rows (real 4/8-bit model states; CPU)

Each row builds the model from its config (no downloads), wraps it with `deepspeed.initialize` using the
config `jobspec.compile.compiler` writes, runs a few steps on random tokens and reads the allocator's peak
(`torch.cuda.max_memory_allocated`, less what was still allocated when the row began) and NVML's used
memory of the whole GPU after the last step, while the caching allocator still holds the row's blocks
(what nvidia-smi would show). All rows run in one process, one after another: a process per row would
pay the torch/DeepSpeed imports 17 times. Prints a markdown table with the error of each row and the
median absolute error. The two SEED_ROWS are seed 000's XLM-R large setting (fp16, eager attention).

`--memtracker` needs no GPU: for 12 settings (9 architectures, real sizes) it compares the planner's
activation term, composed from short unit traces, with torch's own MemTracker over one forward +
backward of the whole model on fake tensors (`memtracker_peak`); it exits 1 when a row is more than 5%
off. `--guide` and `--seeds` also print, for their torch-AMP rows, an estimate of AMP itself
(`amp_estimate`), which is not the planner: the planner models DeepSpeed's fp16.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobspec.compile.compiler import compile_spec  # noqa: E402
from jobspec.memory.gpu_overheads import cuda_context  # noqa: E402
from jobspec.memory.planner import plan_memory  # noqa: E402

CUDA_CONTEXT_BYTES = cuda_context(None, None).bytes   # the planner's figure for an unknown GPU
from jobspec.model.planner_trace import job_profiler  # noqa: E402
from jobspec.spec.derived import derive  # noqa: E402
from jobspec.spec.schema import fill_defaults  # noqa: E402
from jobspec.units import MiB  # noqa: E402

PROFILER = job_profiler()   # the planner's traced model profile, unit traces cached on disk

MODELS = {
    "bert-large": {"architecture": "bert", "config": {"hidden_size": 1024, "num_hidden_layers": 24,
                                                      "num_attention_heads": 16, "intermediate_size": 4096}},
    "xlmr-large": {"architecture": "xlm-roberta", "config": {
        "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
        "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1}},
    "xlmr-base": {"architecture": "xlm-roberta", "config": {
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
        "vocab_size": 250002, "max_position_embeddings": 514, "type_vocab_size": 1}},
}
# (model, seq, micro, precision, checkpointing, optimizer, zero stage, optimizer offload)
ROWS = [
    ("bert-large", 128, 8, "fp32", False, "adamw", 0, "none"),
    ("bert-large", 512, 4, "fp32", False, "adamw", 0, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 0, "none"),
    ("bert-large", 512, 4, "fp16", True, "adamw", 0, "none"),
    ("bert-large", 512, 8, "bf16", {"every_n_layers": 2}, "adamw", 0, "none"),
    ("bert-large", 512, 1, "fp32", True, "adamw", 0, "none"),
    ("bert-large", 512, 4, "fp32", False, "adamw_8bit", 0, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 1, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 2, "none"),
    ("bert-large", 512, 4, "bf16", False, "adamw", 3, "none"),
    ("bert-large", 512, 4, "bf16", True, "adamw", 2, "cpu"),
    ("xlmr-large", 512, 8, "bf16", True, "adamw", 0, "none"),
    ("xlmr-large", 128, 8, "bf16", False, "adamw_8bit", 0, "none"),
    ("xlmr-large", 512, 2, "fp32", {"every_n_layers": 2}, "adamw", 0, "none"),
    ("xlmr-large", 512, 4, "bf16", True, "adamw", 3, "cpu"),
]
# Seed 000's XLM-R large rows, as close as a DeepSpeed job gets: micro-batch 8, seq 512, fp16, the
# eager attention of its time, without and with checkpointing (its nvidia-smi totals: OOM-free 23.5 GB
# and 11.8 GB on a 24 GB card, HF Trainer with AMP). Keyword `attention` goes to row_spec.
SEED_ROWS = [
    (("xlmr-large", 512, 8, "fp16", False, "adamw", 0, "none"), {"attention": "eager"}),
    (("xlmr-large", 512, 8, "fp16", True, "adamw", 0, "none"), {"attention": "eager"}),
]


def all_rows() -> list[tuple[str, tuple, dict]]:
    """(label, row_spec args, row_spec kwargs) of every measured row: ROWS, then SEED_ROWS; rows with
    an optimizer offload last, so the DeepSpeedCPUAdam build can finish in the background meanwhile."""
    rows = [(row, {}) for row in ROWS] + SEED_ROWS
    rows.sort(key=lambda r: r[0][7] != "none")  # stable: the listed order otherwise
    return [(row_label(row, kwargs), row, kwargs) for row, kwargs in rows]


def row_label(row: tuple, kwargs: dict) -> str:
    label = " ".join(str(c if not isinstance(c, dict) else f"every{c['every_n_layers']}") for c in row)
    return label + "".join(f" {v}" for v in kwargs.values())
# HF "Efficient training on a single GPU" (V100 16 GB, HF Trainer, no DeepSpeed, eager attention):
# bert-large-uncased, seq 512; the measured MB include ~1.3 GB of CUDA context.
GUIDE_CONTEXT = 1300 * 10**6
GUIDE = [
    ("vanilla, batch 4", 4, 1, "fp32", False, "adamw", 14949),
    ("batch 1 x accumulation 4", 1, 4, "fp32", False, "adamw", 8681),
    ("+ gradient checkpointing", 1, 4, "fp32", True, "adamw", 6775),
    ("fp16, batch 4", 4, 1, "fp16", False, "adamw", 13939),
    ("batch 1 x 4 + ckpt + fp16", 1, 4, "fp16", True, "adamw", 7275),
    ("Adafactor, batch 4", 4, 1, "fp32", False, "adafactor", 12295),
    ("batch 1 x 4 + ckpt + fp16 + Adafactor", 1, 4, "fp16", True, "adafactor", 4847),
    ("8-bit AdamW, batch 4", 4, 1, "fp32", False, "adamw_8bit", 13085),
    ("everything", 1, 4, "fp16", True, "adamw_8bit", 5363),
]

# Seed 000 (a 2021 blog post): XLM-R base/large sequence classification on one 24 GB RTX 6000, torch AMP
# (autocast + GradScaler) for "mixed precision", HF checkpointing; its VRAM column (nvidia-smi, read
# here as GiB: "23.5G" of a 24G card). It states no sequence length: 512 here (the model's maximum),
# and no optimizer: AdamW. Eager attention (2021). (label, model, batch, precision, ckpt, seed GiB; None: OOM)
SEED_CARD_GIB = 24
SEEDS = [
    ("XLM-R Base", "xlmr-base", 8, "fp32", False, 12.28),
    ("XLM-R Base 1", "xlmr-base", 8, "fp16", False, 10.95),
    ("XLM-R Base 2", "xlmr-base", 16, "fp16", False, 16.96),
    ("XLM-R Large", "xlmr-large", 8, "fp32", False, None),
    ("XLM-R Large 1", "xlmr-large", 8, "fp16", False, 23.5),
    ("XLM-R Large 2", "xlmr-large", 8, "fp16", True, 11.8),
]
SEED_SEQ = 512


def amp_estimate(model: str, seq: int, micro: int, ckpt, optimizer: str, accumulation: int = 1) -> tuple[int, int]:
    """(reserved bytes, activation bytes) of torch AMP training, single GPU, no DeepSpeed: an estimate, not
    the planner. Model states of the fp32 job (fp32 weights and gradients, the optimizer's fp32 states),
    activations traced by MemTracker under `_AutocastEmulation` (fp16 weight copies included), and the
    planner's allocator terms (2 MiB blocks, 7% fragmentation); the caller adds the CUDA context."""
    from jobspec.memory.planner import ALLOCATOR_BLOCK, FRAGMENTATION

    spec = row_spec(model, seq, micro, "fp32", ckpt, optimizer, 0, "none", accumulation, attention="eager")
    states = plan_memory(spec, derive(spec, profiler=PROFILER)).breakdown
    activations = memtracker_peak(spec, "fp32", micro, seq, ckpt, amp=True)["without_gradients"]
    allocated = activations + sum(states[k] for k in ("parameters", "buffers", "gradients", "optimizer_states"))
    return -(-allocated // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK + int(FRAGMENTATION * allocated), activations


def run_seeds() -> int:
    """Planner totals next to seed 000's rows; for its AMP rows also an estimate of AMP itself (not the
    planner): the fp32 job's model states (fp32 weights, gradients, Adam) plus the activations traced by
    MemTracker under `_AutocastEmulation`, with the planner's allocator and context terms."""
    out = []
    for label, model, batch, precision, ckpt, seed_gib in SEEDS:
        spec = row_spec(model, SEED_SEQ, batch, precision, ckpt, "adamw", 0, "none", attention="eager")
        plan = plan_memory(spec, derive(spec, profiler=PROFILER))
        predicted = plan.nvml_total / 2**30
        amp = "-"
        if precision == "fp16":
            reserved, activations = amp_estimate(model, SEED_SEQ, batch, ckpt, "adamw")
            amp_gib = (reserved + CUDA_CONTEXT_BYTES) / 2**30
            amp = f"{amp_gib:.2f} ({activations / 2**30:.2f})"
            if seed_gib is not None:
                amp += f", {100 * (amp_gib / seed_gib - 1):+.1f}%"
        setting = f"batch {batch}, {'AMP fp16' if precision == 'fp16' else 'fp32'}, ckpt {'on' if ckpt else 'off'}"
        activations_gib = sum(plan.breakdown[k] for k in ("activations", "embeddings_activations",
                                                          "logits_and_loss")) / 2**30
        if seed_gib is None:
            seed, error = f"OOM on {SEED_CARD_GIB}", "does not fit" if predicted > SEED_CARD_GIB else "fits (seed: OOM)"
        else:
            seed, error = f"{seed_gib:.2f}", f"{100 * (predicted / seed_gib - 1):+.1f}%"
        out.append((label, setting, f"{predicted:.2f} ({activations_gib:.2f})", seed, error, amp))
    table(out, ["seed row", "setting (seq 512 assumed, eager)",
                "planner GiB: NVML total (traced activations)", "seed GiB (nvidia-smi)", "error",
                "AMP estimate GiB (its activations), error"])
    print("\nplanner: DeepSpeed ZeRO-0 (fp16: 16-bit weights and gradients, fp32 master and Adam, a flat fp32 "
          "gradient at step), reserved + 500 MiB CUDA context. The seed ran torch AMP: fp32 weights and "
          "gradients, fp16 copies made by autocast, fp32 LayerNorm/softmax outputs, no master copy; the AMP "
          "estimate (not the planner) traces that with an emulation of autocast's op lists.")
    return 0


# ---------------------------------------------------------------------------------------- --memtracker
# The planner's activation term (the composed trace) against an independent full-model reference:
# PyTorch's own MemTracker (torch.distributed._tools.mem_tracker) over one forward + backward of the
# whole model on fake CPU tensors. Real model sizes; some stacks are cut to fewer layers (the label says
# so) to keep the run near 2.5 minutes on 2 cores (a fake op costs ~90 µs, its memory nothing).
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
MT_MODELS = {
    "bert-large": ("bert", "sequence-classification", {
        "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096}),
    "bert-base": ("bert", "sequence-classification", {
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}),
    "xlmr-large": ("xlm-roberta", "sequence-classification", MODELS["xlmr-large"]["config"]),
    "xlmr-base": ("xlm-roberta", "sequence-classification", MODELS["xlmr-base"]["config"]),
    "gpt2-124M": ("gpt2", "causal-lm", {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                                        "n_positions": 1024}),
    "llama-3-8B": ("llama", "causal-lm", {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "tie_word_embeddings": False, **_IDS}),
    "qwen2.5-0.5B": ("qwen2", "causal-lm", {
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
        "tie_word_embeddings": True, **_IDS}),
    "gemma-2-2B": ("gemma2", "causal-lm", {
        "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000, "sliding_window": 4096,
        "query_pre_attn_scalar": 256, "max_position_embeddings": 8192, **_IDS}),
    "phi-3-mini": ("phi3", "causal-lm", {
        "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "intermediate_size": 8192, "vocab_size": 32064, "max_position_embeddings": 4096,
        "sliding_window": 2047, **_IDS}),
    "mistral-7B": ("mistral", "causal-lm", {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 32768, "max_position_embeddings": 32768,
        "sliding_window": None, **_IDS}),
    "deberta-v3-base": ("deberta-v2", "sequence-classification", {
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
        "vocab_size": 128100, "max_position_embeddings": 512, "type_vocab_size": 0, "relative_attention": True,
        "max_relative_positions": -1, "position_buckets": 256, "norm_rel_ebd": "layer_norm",
        "share_att_key": True, "pos_att_type": ["p2c", "c2p"], "position_biased_input": False,
        "layer_norm_eps": 1e-7}),
    "llama-tiny": ("llama", "causal-lm", {
        "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 172, "vocab_size": 2000, "max_position_embeddings": 128,
        "tie_word_embeddings": False, **_IDS}),
}
# (model, layers (None: all), attention, precision, micro-batch, seq, checkpointing)
MT_SETTINGS = [
    ("bert-large", None, "eager", "fp32", 4, 512, False),
    ("bert-base", None, "sdpa", "bf16", 32, 128, False),
    ("xlmr-large", None, "eager", "fp16", 8, 512, True),
    ("xlmr-base", None, "eager", "fp32", 8, 512, {"every_n_layers": 2}),
    ("gpt2-124M", None, "sdpa", "fp16", 4, 1024, False),
    ("llama-3-8B", None, "sdpa", "bf16", 1, 4096, True),
    ("llama-3-8B", 8, "sdpa", "fp32", 1, 2048, {"every_n_layers": 4}),
    ("qwen2.5-0.5B", None, "sdpa", "bf16", 4, 2048, False),
    ("gemma-2-2B", 8, "eager", "bf16", 2, 2048, {"every_n_layers": 3}),
    ("phi-3-mini", 8, "sdpa", "fp16", 2, 4096, True),
    ("mistral-7B", 8, "eager", "fp32", 1, 1024, False),
    ("deberta-v3-base", None, "eager", "fp16", 8, 512, {"every_n_layers": 2}),
]
# one tiny setting for the test suite (`--quick`): seconds, not minutes; micro-batch 3, which the planner
# extrapolates from its traces at 1 and 2
MT_QUICK = [("llama-tiny", None, "sdpa", "bf16", 3, 64, {"every_n_layers": 2})]


def mt_spec(model: str, layers: int | None, attention: str) -> dict:
    architecture, task, config = MT_MODELS[model]
    config = dict(config)
    if layers is not None:
        key = next(k for k in ("num_hidden_layers", "n_layer") if k in config)
        config[key] = layers
    return fill_defaults({
        "name": "memtracker", "model": {"architecture": architecture, "task": task, "config": config,
                                        "attention": attention},
        "data": {"synthetic": {"seq_len": 128, "num_samples": 8}},
        "training": {"max_steps": 1, "micro_batch_size": 1, "global_batch_size": 1},
        "logging": {"mlflow": {"enabled": False}},
    })


def mt_label(model, layers, attention, precision, micro, seq, ckpt) -> str:
    architecture, _, config = MT_MODELS[model]
    total = config.get("num_hidden_layers", config.get("n_layer"))
    stack = f" ({layers} of {total} layers)" if layers is not None else ""
    ckpt_text = "ckpt off" if not ckpt else "ckpt every layer" if ckpt is True else \
        f"ckpt every {ckpt['every_n_layers']}"
    return f"{model}{stack} [{architecture}], {attention}, {precision}, {micro} x {seq}, {ckpt_text}"


class _NoHook:
    """A hook handle MemTracker can remove: what it is given for a parameter that gets no gradient."""

    def remove(self) -> None:
        pass


def memtracker_peak(spec: dict, precision: str, micro: int, seq: int, checkpointing, *, amp: bool = False,
                    tiling: tuple = (False, False, False), hold_output: bool = False) -> dict:
    """One forward + backward of the whole model under torch's MemTracker, on fake CPU tensors, built
    and fed as the planner's tracer does; parameter gradients dropped as soon as they are accumulated
    (ZeRO's hooks do that; the planner counts gradients apart). Returns MemTracker's peak snapshot
    (bytes by reference type), `activations`: its peak total less parameters and buffers, and
    `without_gradients`: the same peak over MemTracker's own updates with the storages that became
    parameter gradients left out for their whole life, in flight included (what the planner's trace
    leaves out: `_GradientLedger`). `amp`: fp32 weights, the forward under `_AutocastEmulation` (for
    `--seeds`, whose mixed precision is torch AMP, not a 16-bit model). `tiling`: the tiled loss and MLP
    (model/planner_trace.tiling_setting; not the offload, whose host copies MemTracker would count on the one
    CPU device). The model output is dropped before the backward as the ranks drop it, or with
    `hold_output` kept alive through it (what the trace did before issue 33)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from jobspec.model.kernels import dropout_stand_in, mask_skip_stand_in
    from jobspec.model.kernels import sdpa_stand_in as _sdpa_stand_in
    from jobspec.model.planner_trace import PRECISION_DTYPES, ModelTracer, apply_tiling, checkpoint_setting
    from jobspec.model.step import step_inputs as _inputs
    from jobspec.model.structure import gradient_checkpointing

    model = ModelTracer(spec)._build(layers=None)
    model.train()
    every, reentrant = checkpoint_setting(checkpointing)
    if every:
        gradient_checkpointing(model, every, reentrant)
    if tiling[2]:
        raise ValueError("memtracker_peak: the checkpoint-input offload is not measured here")
    apply_tiling(model, tiling, [])
    model = ModelTracer(spec)._adapt(model)   # model.lora: PEFT's wrap, after the patches as on the ranks
    model = model.to(getattr(torch, PRECISION_DTYPES[precision]))   # on meta: no memory
    tracker = MemTracker()
    collecting = gc.isenabled()
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        # ModTracker warns when a module is gone by its backward: the loss modules some heads create
        # inside forward (BERT's `CrossEntropyLoss()`); only that module's own snapshots are skipped
        warnings.filterwarnings("ignore", message="Module is None")
        model = model.to_empty(device="cpu")
        tracker.track_external(model)
        for param in model.parameters():
            if not param.requires_grad:
                # a frozen base (model.lora): no gradient to hook, and MemTracker's register_hook would raise
                tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
        ledger = _GradientLedger(tracker)   # after the parameters and buffers: it sees the step's storages
        gc.disable()   # as in the tracer: no collection at an arbitrary moment of the step
        try:
            # what a GPU runs, as the trace has it: its attention kernels, dropout and mask decisions
            with _sdpa_stand_in(), dropout_stand_in(), mask_skip_stand_in(), _worst_case_nonzero(), tracker:
                batch = _inputs(spec, getattr(model, "config", None), micro, seq)
                with _AutocastEmulation() if amp else contextlib.nullcontext():
                    output = model(**batch)
                    loss = output.loss if hasattr(output, "loss") else output["loss"]
                    if not hold_output:
                        del output   # as the ranks (train/oom.OomGuard.forward: `loss_of(engine(**batch))`)
                        output = None
                # after the forward: MemTracker's own post-accumulate hooks (installed at each module's
                # first forward) read p.grad, so they must run before this one drops it
                for p in model.parameters():
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(ledger.drop_grad)
                if amp:
                    # checkpointed layers recompute under autocast again (torch.utils.checkpoint restores
                    # it); the engine is called directly because `backward()` goes through
                    # __torch_function__, which runs it with the mode set aside
                    from torch.autograd.graph import _engine_run_backward

                    with _AutocastEmulation(cache=False):
                        _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                             allow_unreachable=True, accumulate_grad=True)
                else:
                    loss.backward()
                del output, loss, batch
        finally:
            if collecting:
                gc.enable()
    peak = {}
    for snapshot in tracker.get_tracker_snapshot("peak").values():   # one device: cpu
        for kind, nbytes in snapshot.items():
            name = getattr(kind, "value", kind)
            peak[name] = peak.get(name, 0) + nbytes
    peak["activations"] = peak["Total"] - peak.get("Parameter", 0) - peak.get("Buffer", 0)
    peak["without_gradients"] = ledger.peak_without_gradients()
    return peak


class _GradientLedger:
    """MemTracker's own snapshot updates, logged (its `_update_snap`, and its `_update_peak_stats`, where
    it takes its peak after each op), to replay them without the parameter gradients' storages.

    MemTracker's peak includes a weight gradient in flight: the storage an op of backward creates and
    AccumulateGrad then stores as `p.grad` (whereupon this ledger's hook drops it). The planner's
    trace leaves such storages out over their whole life, since the planner counts gradients as a
    model state. The replay does the same, with MemTracker's numbers."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.events: list = []          # (winfo, bytes) per update; None where MemTracker checks its peak
        self.gradients: set = set()     # ids of the winfos whose storage became a parameter's .grad
        update, check = tracker._update_snap, tracker._update_peak_stats

        def logged_update(u_type, winfo, old_mem_consumed=None, old_reftype=None):
            name = u_type.name
            delta = {"ADD": winfo.mem_consumed, "DEL": -winfo.mem_consumed,
                     "SIZE": winfo.mem_consumed - (old_mem_consumed or 0)}.get(name, 0)
            if delta:
                self.events.append((winfo, delta))
            return update(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)

        def logged_check(state):
            self.events.append(None)
            return check(state)

        tracker._update_snap, tracker._update_peak_stats = logged_update, logged_check

    def drop_grad(self, param) -> None:
        winfo, _ = self.tracker._WINFO.get(param.grad.untyped_storage(), (None, None))
        if winfo is not None:
            self.gradients.add(id(winfo))
        param.grad = None

    def peak_without_gradients(self) -> int:
        total = peak = 0
        for event in self.events:
            if event is None:
                peak = max(peak, total)
            elif id(event[0]) not in self.gradients:
                total += event[1]
        return peak


class _AutocastEmulation:
    """CUDA autocast (fp16) on fake CPU tensors, as a TorchFunctionMode over the ops a transformer
    calls: CPU autocast has other op lists (no fp32 layer_norm or softmax) and a CPU-only torch cannot
    make fake CUDA tensors (it aborts at the device guard). The matmul family runs in fp16 (casts of
    weights cached for the region, as autocast does); layer_norm, softmax, log_softmax and the losses in
    fp32; everything else in whatever dtype reaches it (the residual adds promote to fp32, as on CUDA).
    An approximation of autocast's lists, used only to explain the seeds' AMP rows."""

    def __new__(cls, cache: bool = True):
        import torch
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode
        from torch.utils._pytree import tree_map

        low = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
               torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.mm, torch.Tensor.mm, torch.einsum}
        fp32 = {F.layer_norm, F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax,
                torch.Tensor.log_softmax, F.cross_entropy, F.nll_loss, F.binary_cross_entropy_with_logits,
                F.mse_loss}

        class Mode(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.cache = {} if cache else None

            def cast(self, dtype):
                def to(t):
                    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype):
                        return t
                    if self.cache is not None and t.is_leaf and t.requires_grad:   # a weight
                        if (id(t), dtype) not in self.cache:
                            self.cache[id(t), dtype] = t.to(dtype)
                        return self.cache[id(t), dtype]
                    return t.to(dtype)
                return to

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in low or func in fp32:
                    to = self.cast(torch.float16 if func in low else torch.float32)
                    args, kwargs = tree_map(to, args), tree_map(to, kwargs)
                return func(*args, **kwargs)

            def __exit__(self, *exc):
                if self.cache is not None:
                    self.cache.clear()   # autocast drops its cast cache when the region ends
                return super().__exit__(*exc)

        return Mode()


def _worst_case_nonzero():
    """A dispatch mode below MemTracker giving `nonzero` its worst-case size, as the tracer's `_dispatch`
    does: fake tensors cannot size a data-dependent output (DeBERTa's classification loss selects its
    labelled rows with it); MemTracker then tracks the op's output like any other."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from jobspec.model.step import dispatch_worst_case as _dispatch

    class WorstCaseNonzero(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return _dispatch(func, args, kwargs or {})

    return WorstCaseNonzero()


def memtracker_row(setting: tuple) -> dict:
    """The planner's composed activation peak and MemTracker's full-model peak for one setting."""
    import time

    from jobspec.model.planner_trace import ModelTracer

    model, layers, attention, precision, micro, seq, ckpt = setting
    spec = mt_spec(model, layers, attention)
    started = time.monotonic()
    planned = ModelTracer(spec).profile(precision, micro, seq, ckpt).activations
    planned_s = time.monotonic() - started
    reference = memtracker_peak(spec, precision, micro, seq, ckpt)
    return {"label": mt_label(*setting), "planner": planned.peak, "memtracker": reference["activations"],
            "error": planned.peak / reference["activations"] - 1, "peak": reference,
            "without_gradients": reference["without_gradients"],
            "error_without_gradients": planned.peak / reference["without_gradients"] - 1,
            "seconds": (planned_s, time.monotonic() - started - planned_s)}


def run_memtracker(settings: list) -> list[dict]:
    rows, out = [], []
    for setting in settings:
        row = memtracker_row(setting)
        rows.append(row)
        peak = row["peak"]
        print(f"planner_accuracy: {row['label']}: planner {row['seconds'][0]:.0f} s, MemTracker "
              f"{row['seconds'][1]:.0f} s", file=sys.stderr, flush=True)
        out.append((row["label"], f"{row['planner'] / MiB:.1f}", f"{row['memtracker'] / MiB:.1f}",
                    f"{100 * row['error']:+.2f}%",
                    " / ".join(f"{peak.get(k, 0) / MiB:.0f}" for k in ("Activation", "Temp", "Gradient")),
                    f"{row['without_gradients'] / MiB:.1f}", f"{100 * row['error_without_gradients']:+.2f}%"))
    table(out, ["setting", "planner activations MiB", "MemTracker MiB", "error",
                "MemTracker at its peak: activation / temp / gradient MiB",
                "MemTracker, gradient storages left out, MiB", "error"])
    for key, what in (("error", "MemTracker's peak less parameters and buffers"),
                      ("error_without_gradients", "the same, parameter-gradient storages left out")):
        errors = [abs(r[key]) for r in rows]
        print(f"\nagainst {what}: median |error| {100 * statistics.median(errors):.2f}%, "
              f"max |error| {100 * max(errors):.2f}% over {len(rows)} settings")
    return rows


def row_spec(model, seq, micro, precision, ckpt, optimizer, stage, offload, accumulation=1, attention="sdpa"):
    return fill_defaults({
        "name": "bench", "model": {**MODELS[model], "task": "sequence-classification", "attention": attention},
        "data": {"synthetic": {"seq_len": seq, "num_samples": 64}},
        "training": {"max_steps": 4, "micro_batch_size": micro, "global_batch_size": micro * accumulation,
                     "optimizer": {"name": optimizer}},
        "memory": {"precision": precision, "activation_checkpointing": ckpt, "zero_stage": stage,
                   "offload": {"optimizer": offload}},
        "logging": {"mlflow": {"enabled": False}},
    })


def measure(spec: dict, steps: int = 3) -> tuple[int, int | None]:
    """(peak allocated bytes, NVML used bytes) of a few real steps on cuda:0 (single rank, DeepSpeed engine)."""
    import deepspeed
    import torch

    from jobspec import optimizers
    from jobspec.hardware import nvml_used_bytes
    from jobspec.model.build import build_model
    from jobspec.train.patches import apply_patches, build_client_optimizer
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    compiled = compile_spec(spec, derive(spec, profiler=PROFILER))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    leftover = torch.cuda.memory_allocated()  # anything an earlier row left behind is not this row's
    model = build_model(spec)
    model, _ = apply_patches(model, compiled.patches)
    client_args = optimizers.get(spec["training"]["optimizer"]["name"]).client_args
    optimizer = build_client_optimizer(model, client_args(spec["training"]["optimizer"])) if client_args else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model.parameters(),
                                      config=compiled.ds_config)
    micro, seq = spec["training"]["micro_batch_size"], spec["data"]["synthetic"]["seq_len"]
    vocab = model.config.vocab_size
    for _ in range(steps * engine.gradient_accumulation_steps()):
        ids = torch.randint(5, vocab - 1, (micro, seq), device=engine.device)
        labels = torch.randint(0, 2, (micro,), device=engine.device)
        engine.backward(engine(input_ids=ids, labels=labels).loss)
        engine.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - leftover
    nvml = nvml_used_bytes(torch.device("cuda", 0))
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, model, optimizer, ids, labels
    gc.collect()
    torch.cuda.empty_cache()
    return peak, nvml


def table(rows, header):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="predictions only, no GPU needed")
    parser.add_argument("--guide", action="store_true", help="compare with the HF guide's bert-large rows")
    parser.add_argument("--memtracker", action="store_true",
                        help="planner activations vs torch's MemTracker over fake tensors (CPU, ~2.5 min)")
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)   # --memtracker, one tiny row
    parser.add_argument("--seeds", action="store_true", help="planner totals next to seed 000's XLM-R rows")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows (bytes) as JSON here")
    args = parser.parse_args(argv)
    if args.memtracker:
        rows = run_memtracker(MT_QUICK if args.quick else MT_SETTINGS)
        return 0 if all(abs(r["error"]) <= 0.05 for r in rows) else 1
    if args.seeds:
        return run_seeds()
    if args.guide:
        out, errors = [], []
        for label, micro, accumulation, precision, ckpt, optimizer, measured_mb in GUIDE:
            spec = row_spec("bert-large", 512, micro, precision, ckpt, optimizer, 0, "none", accumulation,
                            attention="eager")   # the guide predates SDPA in BERT
            plan = plan_memory(spec, derive(spec, profiler=PROFILER))
            predicted_mb = (plan.peak_reserved + GUIDE_CONTEXT) / 10**6
            errors.append(abs(predicted_mb / measured_mb - 1))
            amp = "-"
            if precision == "fp16":   # the guide's fp16 is the Trainer's AMP: estimated apart, not the planner
                reserved, _ = amp_estimate("bert-large", 512, micro, ckpt, optimizer, accumulation)
                amp_mb = (reserved + GUIDE_CONTEXT) / 10**6
                amp = f"{amp_mb:.0f} ({100 * (amp_mb / measured_mb - 1):+.1f}%)"
            out.append((label, f"{predicted_mb:.0f}", measured_mb, f"{100 * (predicted_mb / measured_mb - 1):+.1f}%",
                        amp))
        table(out, ["guide row", "planner MB (reserved + 1.3 GB ctx)", "guide MB", "error",
                    "AMP estimate MB (error)"])
        print(f"\nmedian |error|: {100 * statistics.median(errors):.1f}%  (guide: HF Trainer with "
              "torch AdamW in fp32/amp, not DeepSpeed: its fp16 rows keep fp32 weights and no master copy; "
              "the AMP estimate, not the planner, traces that: see amp_estimate)")
        return 0
    if not args.dry_run and not _has_cuda():
        print("no CUDA device: use --dry-run for predictions only", file=sys.stderr)
        return 2
    out, errors, records = [], [], []
    for label, row, kwargs in all_rows():
        spec = row_spec(*row, **kwargs)
        plan = plan_memory(spec, derive(spec, profiler=PROFILER))
        record = {"label": label, "predicted_allocated": plan.peak_allocated, "predicted_nvml": plan.nvml_total,
                  "measured_allocated": None, "nvml_used": None}
        if not args.dry_run:
            record["measured_allocated"], record["nvml_used"] = measure(spec)
            errors.append(abs(plan.peak_allocated / record["measured_allocated"] - 1))
            print(f"planner_accuracy: {label}: measured {record['measured_allocated'] / MiB:.0f} MiB",
                  file=sys.stderr, flush=True)
        records.append(record)
        out.append(table_row(record))
    table(out, HEADER)
    if errors:
        print(f"\nmedian |error|: {100 * statistics.median(errors):.1f}% over {len(errors)} rows "
              f"(CUDA context not in the allocated column: +{CUDA_CONTEXT_BYTES / MiB:.0f} MiB in the NVML total)")
    if args.json:
        args.json.write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
    return 0


def _has_cuda() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()


HEADER = ["model seq micro precision ckpt optimizer zero offload", "predicted MiB", "measured MiB", "error",
          "predicted NVML MiB", "NVML used MiB"]


def table_row(record: dict) -> tuple:
    def mib(value):
        return "-" if value is None else f"{value / MiB:.0f}"
    predicted, measured = record["predicted_allocated"], record["measured_allocated"]
    error = "-" if measured is None else f"{100 * (predicted / measured - 1):+.1f}%"
    return (record["label"], mib(predicted), mib(measured), error, mib(record["predicted_nvml"]),
            mib(record["nvml_used"]))


if __name__ == "__main__":
    raise SystemExit(main())
