"""Per-rank GPU memory of a job, predicted from the spec alone: the cost model of docs/memory-planner.md.

Pure: spec + ModelDims in, bytes out; no torch. Which copies exist follows DeepSpeed 0.19's own
optimizer wrappers (engine.py picks them): ZeRO-0 fp32 runs the bare optimizer; ZeRO-0 fp16/bf16 wraps
it in FP16_Optimizer (flat fp32 master + a flat fp32 gradient built at step time); ZeRO-1/2
(stage_1_and_2.py) keep the full 16/32-bit parameters, a fp32 master *partition* (a clone even for
fp32 models), a gradient partition and, at step time, its fp32 flat copy; ZeRO-3 (stage3.py)
partitions the parameters too and gathers them layer by layer. Every number is in bytes.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from jobspec.errors import SpecError, spec_error
from jobspec.spec.derived import PRECISION_BYTES, DerivedJob, zero_bucket_sizes
from jobspec.spec.export_rules import resolve_dtype
from jobspec.spec.model_dims import ModelDims
from jobspec.units import MiB, fmt_mib_gib

CUDA_CONTEXT_BYTES = 500 * MiB   # CUDA 12 context + cuBLAS/cuDNN workspaces with lazy module loading
ALLOCATOR_BLOCK = 2 * MiB        # the caching allocator's large-segment granularity
FRAGMENTATION = 0.07             # reserved - allocated at peak, as a fraction (calibrated by bench/)
HF_LOGITS_UPCAST = True          # transformers' loss functions call logits.float()

# Optimizer state bytes per trainable parameter (fp32 states, whatever the training precision).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw_8bit": 2, "sgd": 4}   # adafactor: factored, see below
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B\s*$")


@dataclass(frozen=True)
class Tensors:
    """The parameter inventory the planner needs: total, matrices' shapes, and the rest (vectors)."""

    total: int
    matrices: tuple          # ((rows, cols), ...), embeddings and linear weights
    layer_params: int        # parameters of one transformer layer (ZeRO-3 gathers one at a time)

    @property
    def vector_params(self) -> int:
        return self.total - sum(r * c for r, c in self.matrices)


@dataclass
class MemoryPlan:
    """Predicted per-rank memory; `breakdown` (GPU) and `host` are bytes by component."""

    breakdown: dict
    host: dict
    peak_allocated: int
    peak_reserved: int
    nvml_total: int
    host_total: int
    nvme_total: int
    budget: int | None = None
    settings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    compute: dict = field(default_factory=dict)   # FLOPs per trained token, from the derived job

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.nvml_total <= self.budget

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.nvml_total

    @property
    def model_states(self) -> int:
        """Parameters + gradients + master weights + optimizer states (what DeepSpeed's estimators count)."""
        return sum(self.breakdown[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states"))

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(fits=self.fits, headroom=self.headroom, model_states=self.model_states)
        return d


def parse_bytes(text: str, *, path: tuple = ("memory", "gpu_memory")) -> int:
    """'24GiB' -> 25769803776, '11GB' -> 11e9 (the schema's `gpu_memory` pattern)."""
    match = _SIZE.match(str(text))
    if not match:
        raise spec_error(f"cannot read the memory size {text!r}", path=path,
                         hint="write a number and a unit, e.g. 24GiB, 11GB or 512MiB")
    number, prefix, binary = match.groups()
    power = " KMGT".index(prefix or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)


def parameter_tensors(dims: ModelDims, task: str, num_labels: int) -> Tensors:
    """The weight matrices of the model (shapes only), consistent with `ModelDims.num_parameters`."""
    total = dims.num_parameters(task, num_labels)
    if total is None or not dims.num_layers:
        raise spec_error(f"the planner cannot count the parameters of model type {dims.model_type!r}",
                         path=("model",), hint="use a known architecture (bert, roberta, xlm-roberta, gpt2, "
                         "llama, mistral, distilbert, deberta-v2, mlp) or name its dimensions in model.config")
    h, ffn, vocab = dims.hidden_size, dims.intermediate_size or 4 * dims.hidden_size, dims.vocab_size
    if dims.model_type == "mlp":   # jobspec.model.mlp: embedding, num_layers x Linear(h, h), classifier
        matrices = ((vocab, h),) + ((h, h),) * dims.num_layers + ((h, num_labels),)
        return Tensors(total=total, matrices=matrices, layer_params=h * h + h)
    heads = dims.num_heads or 1
    kv = (dims.num_key_value_heads or heads) * (h // heads)
    gated = dims.model_type in ("llama", "mistral")
    matrices = [(vocab, h)]
    if dims.model_type not in ("llama", "mistral") and dims.position_biased_input:
        matrices.append((dims.max_position_embeddings, h))
    attention = [(h, h), (h, kv), (h, kv), (h, h)]
    mlp = [(h, ffn)] * (2 if gated else 1) + [(ffn, h)]
    matrices += (attention + mlp) * dims.num_layers
    if task in ("masked-lm", "causal-lm"):
        if dims.model_type not in ("gpt2", "llama", "mistral"):
            matrices.append((h, h))               # the MLM head's transform
        if not dims.tie_word_embeddings:
            matrices.append((vocab, h))
    else:
        if task == "sequence-classification" and dims.model_type not in ("gpt2", "llama", "mistral"):
            matrices.append((h, h))               # pooler / classification dense
        matrices.append((h, num_labels))
    layer_matrix = sum(r * c for r, c in attention + mlp)
    layer_vectors = (total - sum(r * c for r, c in matrices)) // max(1, dims.num_layers + 1)
    return Tensors(total=total, matrices=tuple(matrices), layer_params=layer_matrix + layer_vectors)


def optimizer_state_bytes(name: str, momentum: float, tensors: Tensors) -> int:
    """Optimizer state of all trainable parameters, unpartitioned."""
    if name == "adafactor":
        # transformers' Adafactor, beta1=None: a row and a column statistic per matrix, a full
        # second moment for vectors, all fp32.
        return 4 * (sum(r + c for r, c in tensors.matrices) + tensors.vector_params)
    if name == "sgd":
        return 4 * tensors.total if momentum > 0 else 0
    return OPTIMIZER_STATE_BYTES[name] * tensors.total


def checkpoint_bytes(spec: dict, job: DerivedJob) -> int | None:
    """One checkpoint, all ranks' files together: the working weights, the fp32 master copy (mixed
    precision) and the optimizer state, by the planner's bytes per parameter; None when the model's
    parameters cannot be counted."""
    tensors = _countable_tensors(spec, job)
    if tensors is None:
        return None
    optimizer = spec["training"]["optimizer"]
    master = 4 if job.precision_bytes < 4 else 0
    return tensors.total * (job.precision_bytes + master) + \
        optimizer_state_bytes(optimizer["name"], optimizer["momentum"], tensors)


def export_bytes(spec: dict, job: DerivedJob) -> int | None:
    """One exported model directory: every parameter once, in the export's dtype (safetensors adds a
    header of a few KiB); None when the model's parameters cannot be counted."""
    tensors = _countable_tensors(spec, job)
    return None if tensors is None else tensors.total * PRECISION_BYTES[resolve_dtype(spec)]


def _countable_tensors(spec: dict, job: DerivedJob) -> Tensors | None:
    """The model's weight tensors, or None for a model the planner cannot count (the disk checks skip it)."""
    if job.dims is None:
        return None
    try:
        return parameter_tensors(job.dims, spec["model"]["task"], spec["model"]["num_labels"])
    except SpecError:
        return None


def dropout_probability(spec: dict) -> float:
    config = spec["model"]["config"]
    for key in ("hidden_dropout_prob", "resid_pdrop", "dropout", "attention_dropout"):
        if key in config:
            return float(config[key] or 0)
    return 0.0 if spec["model"]["architecture"] in ("llama", "mistral") else 0.1


def activation_bytes(spec: dict, job: DerivedJob, act: int) -> dict:
    """Activations kept for backward: per layer, layers kept whole vs checkpointed, embeddings, logits.

    Per layer (Korthikanti et al. 2022, ffn = 4h, 16-bit): 34·s·b·h + 5·a·s²·b bytes, of which
    2·s·b·h + a·s²·b are 1-byte dropout masks and the rest 2-byte tensors; see the doc for the split.
    """
    dims = job.dims
    if dims.model_type == "mlp":
        return mlp_activation_bytes(spec, job, act)
    s, b, h, a = job.seq_len, job.micro_batch_size, dims.hidden_size, dims.num_heads or 1
    ffn = dims.intermediate_size or 4 * h
    gated = dims.model_type in ("llama", "mistral")
    dropout = dropout_probability(spec) > 0
    eager = spec["model"]["attention"] == "eager"
    # 2-byte tensors: attention 5sbh (QKV input, Q, K, V, out-proj input), 2 LayerNorm inputs 2sbh,
    # MLP input sbh + activation input/output 2·s·b·ffn (gated: gate, up, act, product = 4).
    elements = 8 * s * b * h + (4 if gated else 2) * s * b * ffn
    masks = 2 * s * b * h if dropout else 0
    if eager:
        elements += (2 if dropout else 1) * a * s * s * b   # softmax output (+ dropout output)
        masks += a * s * s * b if dropout else 0
    else:
        elements += 2 * a * s * b   # SDPA/flash keep the output and a fp32 log-sum-exp, no s² scores
    per_layer = act * elements + masks
    layers = dims.num_layers
    ckpt = job.checkpointed_layers
    layer_input = act * s * b * h
    kept = (layers - ckpt) * per_layer + ckpt * layer_input
    recompute = per_layer if ckpt else 0          # one checkpointed layer re-run in backward
    embeddings = 3 * act * s * b * h + (s * b * h if dropout else 0) + 3 * 8 * s * b  # sum, LN in/out, ids
    task = spec["model"]["task"]
    logits = 0
    if task in ("masked-lm", "causal-lm"):
        vocab = dims.vocab_size
        # lm logits (act dtype) + their fp32 upcast for the loss + fp32 log-softmax saved for backward
        # + the fp32 gradient of the logits in backward.
        upcast = 4 if (HF_LOGITS_UPCAST and act < 4) else 0
        logits = b * s * vocab * (act + upcast + 4 + 4)
        if dims.model_type not in ("gpt2", "llama", "mistral"):
            embeddings += 3 * act * s * b * h     # the MLM head's transform
    else:
        logits = b * (s if task == "token-classification" else 1) * spec["model"]["num_labels"] * 4 * 3
    return {"activations": kept + recompute, "embeddings_activations": embeddings, "logits_and_loss": logits}


def mlp_activation_bytes(spec: dict, job: DerivedJob, act: int) -> dict:
    """Activations of jobspec's deep MLP (jobspec/model/mlp.py), measured exactly by bench/checkpoint_segments.py.

    After the mean-pool every activation is a (b, h) matrix. A layer's Linear saves its input and its
    ReLU saves its output, but that output *is* the next Linear's input (one storage), and the
    pre-ReLU matrix is not kept (ReLU's backward reads its result): num_layers + 1 matrices in all
    (the pooled input, each ReLU output; the last is the classifier's input). A checkpointed layer
    keeps exactly its input, which the layer before keeps anyway, so every_n_layers saves nothing
    here; it only adds the recomputed layer's output (one matrix) during backward.
    Embedding/pooling: the ids (int64) and the pooling weights (b, s) are kept; the (b, s, h)
    embedding output lives only until the pooling, and its gradient only at the end of backward.
    """
    dims, b, h, seq = job.dims, job.micro_batch_size, job.dims.hidden_size, job.seq_len
    matrix = act * b * h
    recompute = matrix if job.checkpointed_layers else 0
    embeddings = 8 * b * seq + act * b * seq
    logits = b * spec["model"]["num_labels"] * 4 * 3
    return {"activations": (dims.num_layers + 1) * matrix + recompute, "embeddings_activations": embeddings,
            "logits_and_loss": logits}


def plan_memory(spec: dict, job: DerivedJob, *, budget: int | None = None) -> MemoryPlan:
    """Predicted per-rank peak memory of `spec` (a resolved spec with defaults filled) and its derived job."""
    dims = job.dims
    if dims is None:
        raise spec_error("the planner needs the model's dimensions (hidden size, layers, vocabulary)",
                         path=("model", "config"),
                         hint="set model.architecture to a known family or give model.config.hidden_size etc.")
    memory, training, model = spec["memory"], spec["training"], spec["model"]
    world = job.world_size
    tensors = parameter_tensors(dims, model["task"], model["num_labels"])
    psi, stage = tensors.total, memory["zero_stage"]
    precision, lp = job.precision, job.precision_bytes
    offload_opt, offload_params = memory["offload"]["optimizer"], memory["offload"]["params"]
    optimizer = training["optimizer"]
    notes: list[str] = []
    if model["freeze"]:
        notes.append("model.freeze is ignored: every parameter is counted as trainable (an upper bound)")

    part = lambda n: math.ceil(n / world) if stage >= 1 else n   # noqa: E731 - the ZeRO partition of n
    opt_states = optimizer_state_bytes(optimizer["name"], optimizer["momentum"], tensors)
    gpu = dict.fromkeys(("parameters", "gradients", "master_weights", "optimizer_states", "step_gradients",
                         "gathered_parameters", "activations", "embeddings_activations", "logits_and_loss", "zero_buffers"), 0)
    host = {"model_init": 4 * psi}    # each rank builds the model in fp32 on the host first
    nvme = 0
    # the sizes compile_spec writes into zero_optimization (an explicit 0 stays 0)
    sizes = zero_bucket_sizes(spec["memory"]["zero"], dims.hidden_size)
    bucket = sizes["reduce_bucket_size"]

    if stage == 0:
        gpu["parameters"], gpu["gradients"] = lp * psi, lp * psi
        gpu["optimizer_states"] = opt_states
        if lp < 4:   # FP16_Optimizer: flat fp32 master; at step a flat fp32 copy of all gradients
            gpu["master_weights"], gpu["step_gradients"] = 4 * psi, 4 * psi
    else:
        # the stage-1/2 gradient partition buffer holds whole parameters: the ones straddling the
        # partition's edges come in full
        straddle = lp * _straddle(tensors, world) if stage in (1, 2) else 0
        if stage == 3:
            persistent = _persistent_params(tensors, sizes["stage3_param_persistence_threshold"])
            # the layer in use + the one prefetched, gathered whole during forward and backward
            gpu["gathered_parameters"] = lp * 2 * tensors.layer_params
            gpu["parameters"] = lp * (persistent + (part(psi) if offload_params == "none" else 0))
        else:
            gpu["parameters"] = lp * psi
        fp32_states = 4 * part(psi) + part(opt_states)   # master partition + optimizer states
        if offload_opt == "none":
            gpu["master_weights"], gpu["optimizer_states"] = 4 * part(psi), part(opt_states)
            if stage == 1:
                # stage 1 keeps the full gradients until the boundary's reduce, then partitions them
                gpu["gradients"] = max(lp * psi, lp * part(psi) + straddle)
            else:
                gpu["gradients"] = lp * part(psi) + straddle
            gpu["step_gradients"] = 4 * part(psi)          # the fp32 flat gradient built at step time
            host_opt = 0
        else:
            gpu["gradients"] = 0                            # reduced into buckets, copied to host
            host_opt = fp32_states + 4 * part(psi) + (lp * part(psi) if stage < 3 else 0)
            if offload_opt == "nvme":
                nvme += fp32_states
                host_opt = 4 * part(psi) + lp * part(psi)   # swap buffers for grads/params
        gpu["zero_buffers"] = lp * bucket * (2 if stage == 3 or offload_opt != "none" else 1)
        if stage == 3:
            gpu["zero_buffers"] += lp * sizes["stage3_prefetch_bucket_size"]
        host["offloaded_optimizer"] = host_opt
        if offload_params != "none":
            host["offloaded_parameters"] = lp * part(psi)
            if offload_params == "nvme":
                nvme += lp * part(psi)
                buffers = memory["offload"]["buffer_count"] * memory["offload"]["buffer_size"]
                host["offloaded_parameters"] = lp * buffers

    micro, seq = job.micro_batch_size, job.seq_len
    gpu.update(activation_bytes(spec, job, lp))
    # The step-time fp32 gradient copy exists only while the activations are already freed.
    forward_backward = sum(gpu[k] for k in ("activations", "embeddings_activations", "logits_and_loss"))
    static = sum(gpu[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states", "zero_buffers",
                                  "gathered_parameters"))
    allocated = static + max(forward_backward, gpu["step_gradients"])
    reserved = _round_up(allocated, ALLOCATOR_BLOCK) + int(FRAGMENTATION * allocated)
    host_total = max(host["model_init"], sum(v for k, v in host.items() if k != "model_init"))
    settings = {"world_size": world, "zero_stage": stage, "precision": precision, "micro_batch_size": micro,
                "seq_len": seq, "parameters": psi, "optimizer": optimizer["name"],
                "checkpointed_layers": job.checkpointed_layers, "layers": dims.num_layers,
                "offload_optimizer": offload_opt, "offload_params": offload_params,
                "attention": model["attention"]}
    return MemoryPlan(breakdown=gpu, host=host, peak_allocated=allocated, peak_reserved=reserved,
                      nvml_total=reserved + CUDA_CONTEXT_BYTES, host_total=host_total, nvme_total=nvme,
                      budget=budget, settings=settings, notes=notes,
                      compute={"model_flops_per_token": job.model_flops_per_token,
                               "hardware_flops_per_token": job.hardware_flops_per_token})


def _persistent_params(tensors: Tensors, threshold: int) -> int:
    """ZeRO-3 keeps tensors of at most `threshold` elements whole on every rank (DeepSpeed's
    `ds_numel <= param_persistence_threshold`): the vectors (counted whole: each is far below the
    usual 10·h), tiny heads; with a threshold of 0, none."""
    if threshold <= 0:
        return 0
    return tensors.vector_params + sum(r * c for r, c in tensors.matrices if r * c <= threshold)


def _straddle(tensors: Tensors, world: int) -> int:
    """Elements of parameters that overlap a rank's partition but lie outside it (worst rank)."""
    if world == 1:
        return 0
    size = math.ceil(tensors.total / world)
    sizes = [r * c for r, c in tensors.matrices]
    scale = tensors.total / sum(sizes)      # spread the vectors (not listed) over the matrices
    start = 0.0
    edges = [(rank * size, (rank + 1) * size) for rank in range(world)]
    extra = [0.0] * world
    for n in sizes:
        n *= scale
        end = start + n
        for rank, (lo, hi) in enumerate(edges):
            if start < hi and end > lo:
                extra[rank] += max(0.0, lo - start) + max(0.0, end - hi)
        start = end
    return int(max(extra))


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


ROWS = (("parameters", "parameters (working copy)"), ("gradients", "gradients"),
        ("master_weights", "fp32 master weights"), ("optimizer_states", "optimizer states"),
        ("step_gradients", "fp32 gradients at step"), ("gathered_parameters", "ZeRO-3 gathered layers"),
        ("activations", "layer activations"),
        ("embeddings_activations", "embedding/head activations"), ("logits_and_loss", "logits and loss"),
        ("zero_buffers", "ZeRO buckets"))


def render_plan(plan: MemoryPlan, title: str = "") -> str:
    """The plain-text table `jobspec plan` prints."""
    s = plan.settings
    lines = [title] if title else []
    ckpt = f"{s['checkpointed_layers']}/{s['layers']} layers" if s["checkpointed_layers"] else "off"
    lines.append(f"{s['parameters'] / 1e6:.1f}M params, {s['precision']}, ZeRO-{s['zero_stage']} x {s['world_size']} "
                 f"rank(s), micro-batch {s['micro_batch_size']} x seq {s['seq_len']}, optimizer {s['optimizer']}, "
                 f"checkpointing {ckpt}, attention {s['attention']}, offload optimizer={s['offload_optimizer']} "
                 f"params={s['offload_params']}")
    rows = [(label, plan.breakdown[key]) for key, label in ROWS if plan.breakdown[key]]
    rows += [("peak allocated", plan.peak_allocated), ("peak reserved (allocator)", plan.peak_reserved),
             ("GPU total incl. CUDA context", plan.nvml_total), ("host RAM per rank", plan.host_total)]
    if plan.nvme_total:
        rows.append(("NVMe per rank", plan.nvme_total))
    width = max(len(label) for label, _ in rows)
    for i, (label, value) in enumerate(rows):
        if i == len(rows) - (5 if plan.nvme_total else 4):
            lines.append("-" * (width + 14))
        lines.append(f"  {label:<{width}}  {fmt_mib_gib(value):>10}")
    if plan.budget is not None:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(f"{verdict} in {fmt_mib_gib(plan.budget)}: headroom {fmt_mib_gib(plan.headroom)}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
