"""Per-rank GPU memory of a job: the cost model of docs/memory-planner.md over the model's measured
profile.

Pure: spec + DerivedJob (its `profile`: the parameter inventory and the traced activations of
jobspec/model/planner_trace.py) in, bytes out; no torch. Which copies exist follows DeepSpeed 0.19's
own optimizer wrappers (engine.py picks them): ZeRO-0 fp32 runs the bare optimizer; ZeRO-0 fp16/bf16
wraps it in FP16_Optimizer (flat fp32 master + a flat fp32 gradient built at step time); ZeRO-1/2
(stage_1_and_2.py) keep the full 16/32-bit parameters, a fp32 master *partition* (a clone even for
fp32 models), a gradient partition and, at step time, its fp32 flat copy; ZeRO-3 (stage3.py)
partitions the parameters too and gathers them layer by layer. Every number is in bytes.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from jobspec import optimizers
from jobspec.errors import spec_error
from jobspec.export.rules import resolve_dtype
from jobspec.memory import host_ram as host_memory
from jobspec.memory.gpu_overheads import ContextFigure, cuda_context
from jobspec.memory.model_profile import Inventory, UnitTrace
from jobspec.memory.ulysses_buffers import all_to_all_bytes
from jobspec.spec.derived import PRECISION_BYTES, DerivedJob, zero_bucket_sizes
from jobspec.spec.types import (
    JobSpec,
    JobSpecMemory,
    JobSpecModelQuantization,
    JobSpecTrainingOptimizer,
)
from jobspec.techniques import tiled_loss
from jobspec.techniques.fused_kernels import fused_loss
from jobspec.units import MiB, fmt_mib_gib

ALLOCATOR_BLOCK = 2 * MiB        # the caching allocator's large-segment granularity
# reserved - allocated at peak, as a fraction (calibrated by bench/)
FRAGMENTATION = 0.07
# The ranks run PyTorch's allocator with expandable segments (ALLOCATOR_CONF, unless the user set
# PYTORCH_CUDA_ALLOC_CONF): a segment grows by mapping 2 MiB pages instead of a new cudaMalloc per
# size class, so blocks freed between sizes are reused; what remains is the unused tail of the last
# page and freed blocks between live ones. An estimate, not yet measured on a GPU
# (docs/memory-planner.md).
EXPANDABLE_FRAGMENTATION = 0.03
ALLOCATOR_CONF = "expandable_segments:True"
ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B\s*$")


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
    host_budget: int | None = None   # a node's RAM (resources.host_mem, else the launching host's)
    ranks_per_node: int = 1
    cpu_ranks: bool = False   # the ranks run on CPUs: their tensors in host RAM (host["tensors"])

    @property
    def gpu_fits(self) -> bool | None:
        return None if self.budget is None else self.nvml_total <= self.budget

    @property
    def host_per_node(self) -> int:
        return self.host_total * self.ranks_per_node

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_budget is None else self.host_per_node <= self.host_budget

    @property
    def fits(self) -> bool | None:
        """GPU and host both fit: False when either is known not to, else the GPU's verdict (None
        without a GPU budget; a node of unknown RAM is not checked)."""
        if self.gpu_fits is False or self.host_fits is False:
            return False
        return self.gpu_fits

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.nvml_total

    @property
    def model_states(self) -> int:
        """Parameters + gradients + master weights + optimizer states (what DeepSpeed's estimators
        count)."""
        return sum(self.breakdown[k]
                   for k in ("parameters", "gradients", "master_weights", "optimizer_states"))

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(fits=self.fits, headroom=self.headroom, model_states=self.model_states,
                 gpu_fits=self.gpu_fits, host_fits=self.host_fits, host_per_node=self.host_per_node)
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


def optimizer_state_bytes(optimizer: JobSpecTrainingOptimizer, inventory: Inventory) -> int:
    """Optimizer state of all trainable parameters, unpartitioned, for the spec's
    `training.optimizer`: its module (jobspec/optimizers) counts it from the inventory (fp32 states,
    whatever the training precision)."""
    return optimizers.get(optimizer["name"]).state_bytes(optimizer, inventory)


def checkpoint_bytes(spec: JobSpec, job: DerivedJob) -> int | None:
    """One checkpoint, all ranks' files together: the working weights, the fp32 master copy (mixed
    precision) and the optimizer state, by the planner's bytes per parameter; None when the model's
    parameters cannot be counted."""
    if job.profile is None:
        return None
    inventory = job.profile.inventory
    optimizer = spec["training"]["optimizer"]
    master = 4 if job.precision_bytes < 4 else 0
    return inventory.total * job.precision_bytes + inventory.trainable * master + \
        optimizer_state_bytes(optimizer, inventory)


def export_bytes(spec: JobSpec, job: DerivedJob) -> int | None:
    """One exported model directory: every parameter once, in the export's dtype (safetensors adds a
    header of a few KiB); None when the model's parameters cannot be counted."""
    if job.profile is None:
        return None
    return job.profile.inventory.total * PRECISION_BYTES[resolve_dtype(spec)]


def allocator_conf(environ: Mapping[str, str]) -> tuple[str, bool]:
    """(PYTORCH_CUDA_ALLOC_CONF the GPU ranks run with, whether jobspec chose it): the user's value
    when set, else expandable segments."""
    value = environ.get(ALLOCATOR_VARIABLE)
    return (value, False) if value else (ALLOCATOR_CONF, True)


def expandable(conf: str) -> bool:
    """Whether an allocator configuration turns expandable segments on."""
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return options.get("expandable_segments", "").lower() == "true"


def plan_memory(spec: JobSpec, job: DerivedJob, *, budget: int | None = None,
                host_budget: int | None = None, expandable_segments: bool = True,
                context: ContextFigure | None = None, cpu_ranks: bool = False) -> MemoryPlan:
    """Predicted per-rank peak memory of `spec` (a resolved spec with defaults filled) and its
    derived job (derived with a profiler: `job.profile` holds the measured model); `budget` per GPU,
    `host_budget` per node; `expandable_segments`: the allocator the ranks run (`allocator_conf`);
    `context`: the CUDA context of the GPU it runs on (memory/gpu_overheads.cuda_context; default:
    GPU unknown); `cpu_ranks`: the ranks run on CPUs, where the tensors a GPU would hold
    (`peak_allocated`) are in the rank's host RAM beside its process (host["tensors"]: no CUDA
    allocator rounds them)."""
    profile = job.profile
    if profile is None:
        if job.profile_error is not None:
            raise job.profile_error
        raise spec_error("the planner needs the model's profile (the job was derived without a "
                         "profiler)",
                         path=("model",),
                         hint="derive the job with jobspec.model.planner_trace.job_profiler()")
    memory, training, model = spec["memory"], spec["training"], spec["model"]
    world = job.world_size
    inventory = profile.inventory
    stage, lp = memory["zero_stage"], job.precision_bytes
    optimizer = training["optimizer"]
    notes: list[str] = list(profile.notes)

    opt_states = optimizer_state_bytes(optimizer, inventory)
    gpu = dict.fromkeys(("parameters", "buffers", "gradients", "master_weights",
                         "optimizer_states", "step_gradients",
                         "gathered_parameters", "activations", "embeddings_activations",
                         "logits_and_loss",
                         "zero_buffers", "dequantized_weight", "all_to_all_buffers",
                         "gradients_at_peak"), 0)
    # the working copy of every parameter: lp bytes each, bitsandbytes' packed weights and constants
    # for a quantised base (model.quantization); `shrink` scales what ZeRO-3 gathers of a layer
    # alike
    weights = weight_bytes(inventory, lp, model["quantization"])
    # the process, then the model as this rank builds it (memory/host_ram.py: on a GPU rank
    # outside ZeRO-3 on the GPU); offload buffers and workers below. The GPU's own construction peak
    # (the weights, plus one layer in 16 bits while a quantised base is made) stays below the
    # step's.
    host = {"runtime": host_memory.RUNTIME_BYTES,
            "construction": host_memory.construction_bytes(
                inventory, stage, world, lp, gpu_ranks=not cpu_ranks,
                pretrained=bool(model["name_or_path"]),
                quantized_weights=weights if inventory.quantized else None)}
    gpu["buffers"] = inventory.buffer_bytes(lp)
    nvme = _model_state_terms(memory, job, inventory, opt_states, weights, gpu, host)

    trace, grads_made = _activation_terms(spec, job, gpu, notes)
    forward_backward = trace.peak + gpu["dequantized_weight"] + gpu["all_to_all_buffers"]
    static = sum(gpu[k] for k in ("parameters", "buffers", "master_weights", "optimizer_states",
                                  "zero_buffers", "gathered_parameters"))
    held = 0 if grads_made else gpu["gradients"]   # the gradients through forward and backward
    allocated = static + max(held + forward_backward, gpu["gradients"] + gpu["step_gradients"])
    if grads_made:
        notes.append(f"gradients are made during the backward (ZeRO-0, one micro-batch per step): "
                     f"{fmt_mib_gib(gpu['gradients_at_peak'])} of them exist at the activations' "
                     f"peak, all {fmt_mib_gib(gpu['gradients'])} at the optimizer step")
    fragmentation = EXPANDABLE_FRAGMENTATION if expandable_segments else FRAGMENTATION
    reserved = _round_up(allocated, ALLOCATOR_BLOCK) + int(fragmentation * allocated)
    host["dataloader_workers"] = host_memory.worker_bytes(spec["data"]["num_workers"])
    # the data's index on the rank (its records are memory-mapped): the samples a derived job
    # counted
    host["data_index"] = host_memory.data_bytes(job.num_train_samples or 0,
                                                bool(spec["data"].get("packing")))
    host["offloaded_activations"] = offloaded_activation_bytes(spec, job)
    if cpu_ranks:
        host["tensors"] = allocated
    host_total = host_memory.host_peak(host)
    figure = context if context is not None else cuda_context(None, None)
    settings = _settings(spec, job, figure, expandable_segments=expandable_segments,
                         grads_made=grads_made)
    return MemoryPlan(breakdown=gpu, host=host, peak_allocated=allocated, peak_reserved=reserved,
                      nvml_total=reserved + figure.bytes, host_total=host_total, nvme_total=nvme,
                      budget=budget, settings=settings, notes=notes,
                      compute={"model_flops_per_token": job.model_flops_per_token,
                               "hardware_flops_per_token": job.hardware_flops_per_token},
                      host_budget=host_budget, ranks_per_node=job.gpus_per_node,
                      cpu_ranks=cpu_ranks)


def _settings(spec: JobSpec, job: DerivedJob, figure: ContextFigure, *, expandable_segments: bool,
              grads_made: bool) -> dict:
    """The settings a plan was made for (`MemoryPlan.settings`: the plan's first line, `--fit`)."""
    memory, model, profile = spec["memory"], spec["model"], job.profile
    assert profile is not None, "plan_memory checks the profile first"
    inventory = profile.inventory
    world, stage, precision = job.world_size, memory["zero_stage"], job.precision
    psi, trainable, optimizer = inventory.total, inventory.trainable, spec["training"]["optimizer"]
    offload_opt, offload_params = memory["offload"]["optimizer"], memory["offload"]["params"]
    return {"world_size": world, "zero_stage": stage, "precision": precision,
                "micro_batch_size": job.micro_batch_size, "seq_len": job.seq_len, "parameters": psi,
                "trainable_parameters": trainable,
                "optimizer": optimizer["name"], "checkpointed_layers": job.checkpointed_layers,
                "layers": inventory.num_layers, "offload_optimizer": offload_opt,
            "offload_params": offload_params,
                "attention": model["attention"], "trace": profile.method,
                "tiled_loss": tiled_loss.plan_text(memory["tiled_loss"]),
            "tiled_mlp": bool(memory["tiled_mlp"]),
                "kernels": model["kernels"],
                "sequence_parallel": job.sequence_parallel,
                "allocator": "expandable segments" if expandable_segments
            else "caching (no expandable segments)",
                "cuda_context": f"{fmt_mib_gib(figure.bytes)}, {figure.source}",
                "gradients_held": not grads_made}


def _activation_terms(spec: JobSpec, job: DerivedJob, gpu: dict,
                      notes: list[str]) -> tuple[UnitTrace, bool]:
    """The traced activations' terms of `gpu` (set in place, with the dequantised weight and
    Ulysses' buffers beside them); returns the trace of the step's peak and whether its gradients
    are made during the backward rather than held through it."""
    profile, model = job.profile, spec["model"]
    assert profile is not None, "plan_memory checks the profile first"
    inventory, stage, precision = profile.inventory, spec["memory"]["zero_stage"], job.precision
    # ZeRO-0 sets every gradient to None after the step (engine.zero_grad / the optimizer's
    # zero_grad(set_to_none=True)): a step of one micro-batch makes them during its backward, so its
    # peak holds the gradients made by then, not all of them. With accumulation, or under ZeRO 1-3
    # (gradient partitions and buckets), they are held through the forward. The composed trace of
    # that peak is exact for a stack whose layers are alike (every layer checkpointed, or none);
    # with one in k checkpointed the peak's place depends on which layers are where, so all are held
    # (an upper bound).
    alike = job.checkpointed_layers in (0, inventory.num_layers) or profile.method == "full"
    grads_made = stage == 0 and job.gradient_accumulation_steps == 1 and alike
    trace = profile.activations.with_gradients() if grads_made else profile.activations
    regions = trace.regions
    gpu.update(activations=regions["layers"], embeddings_activations=regions["embeddings"],
               logits_and_loss=regions["logits_and_loss"], gradients_at_peak=regions["gradients"])
    # The step-time fp32 gradient copy exists only while the activations are already freed.
    if inventory.quantized:
        # bitsandbytes dequantises one weight at a time to the compute dtype for its matmul (forward
        # and backward): the largest such copy lives beside the traced activations
        quant = model["quantization"]
        assert quant is not None, "quantized weights come from model.quantization"
        compute = PRECISION_BYTES[precision if quant["compute_dtype"] == "auto"
                                  else quant["compute_dtype"]]
        gpu["dequantized_weight"] = compute * max(math.prod(s)
                                                  for s in inventory.quantized_shapes())
        notes.append(f"{sum(math.prod(s) for s in inventory.quantized_shapes()) / 1e6:.1f}M base "
                     f"weights in {quant['bits']}-bit with their quantisation constants")
    if model["kernels"] != "none":
        notes.append(kernels_note(spec))
    # memory.sequence_parallel: the trace is one rank's shard (spec/derived); Ulysses' exchange
    # comes on top
    gpu["all_to_all_buffers"] = all_to_all_bytes(job)
    return trace, grads_made


def _model_state_terms(memory: JobSpecMemory, job: DerivedJob, inventory: Inventory,
                       opt_states: int, weights: int, gpu: dict, host: dict) -> int:
    """The model states' terms of `gpu` and `host` by ZeRO stage, offload and freezing (set in
    place); returns the NVMe bytes per rank."""
    world, lp, stage = job.world_size, job.precision_bytes, memory["zero_stage"]
    psi, trainable = inventory.total, inventory.trainable
    offload_opt, offload_params = memory["offload"]["optimizer"], memory["offload"]["params"]

    def part(n: int) -> int:   # the ZeRO partition of n
        return math.ceil(n / world) if stage >= 1 else n

    nvme = 0
    # the sizes compile_spec writes into zero_optimization (an explicit 0 stays 0)
    sizes = zero_bucket_sizes(memory["zero"], job.dims.hidden_size if job.dims else None)
    bucket = sizes["reduce_bucket_size"]
    shrink = weights / (lp * psi) if psi else 1.0
    # ZeRO-3's share
    weights_part = math.ceil(weights / world) if inventory.quantized else lp * part(psi)

    # Frozen parameters (model.freeze) have a working copy but no gradient, master copy or optimizer
    # state.
    if stage == 0:
        gpu["parameters"], gpu["gradients"] = weights, lp * trainable
        gpu["optimizer_states"] = opt_states
        if lp < 4:   # FP16_Optimizer: flat fp32 master; at step a flat fp32 copy of all gradients
            gpu["master_weights"], gpu["step_gradients"] = 4 * trainable, 4 * trainable
    else:
        # the stage-1/2 gradient partition buffer holds whole parameters: the ones straddling the
        # partition's edges come in full
        straddle = lp * _straddle(inventory, world) if stage in (1, 2) else 0
        if stage == 3:
            persistent = _persistent_params(inventory, sizes["stage3_param_persistence_threshold"])
            # the layer in use + the one prefetched, gathered whole during forward and backward
            gpu["gathered_parameters"] = int(lp * 2 * inventory.layer_params * shrink)
            gpu["parameters"] = lp * persistent + (weights_part if offload_params == "none" else 0)
        else:
            gpu["parameters"] = weights
        fp32_states = 4 * part(trainable) + part(opt_states)   # master partition + optimizer states
        if offload_opt == "none":
            gpu["master_weights"], gpu["optimizer_states"] = 4 * part(trainable), part(opt_states)
            if stage == 1:
                # stage 1 keeps the full gradients until the boundary's reduce, then partitions them
                gpu["gradients"] = max(lp * trainable, lp * part(trainable) + straddle)
            else:
                gpu["gradients"] = lp * part(trainable) + straddle
            # the fp32 flat gradient built at step time
            gpu["step_gradients"] = 4 * part(trainable)
            host_opt = 0
        else:
            gpu["gradients"] = 0                            # reduced into buckets, copied to host
            host_opt = fp32_states + 4 * part(trainable) \
                + (lp * part(trainable) if stage < 3 else 0)
            if offload_opt == "nvme":
                nvme += fp32_states
                # swap buffers for grads/params
                host_opt = 4 * part(trainable) + lp * part(trainable)
        gpu["zero_buffers"] = lp * bucket * (2 if stage == 3 or offload_opt != "none" else 1)
        if stage == 3:
            gpu["zero_buffers"] += lp * sizes["stage3_prefetch_bucket_size"]
        host["offloaded_optimizer"] = host_opt
        if offload_opt != "none":
            host.update(_offload_extras(inventory, memory, stage, world, lp, opt_states,
                                        job.gradient_accumulation_steps,
                                        nvme=offload_opt == "nvme"))
        if offload_params != "none":
            host["offloaded_parameters"] = weights_part
            if offload_params == "cpu":
                # stage3.py `_create_param_groups_fp16_flat_cpu_memory` pins the flat partition
                # whatever `pin_memory` says (one flat buffer: the undecayed group is counted
                # unrounded)
                host["pinned_rounding"] = host.get("pinned_rounding", 0) + \
                    host_memory.pinned_bytes(weights_part) - weights_part
            if offload_params == "nvme":
                nvme += weights_part
                buffers = memory["offload"]["buffer_count"] * memory["offload"]["buffer_size"]
                host["offloaded_parameters"] = lp * buffers

    return nvme


# DeepSpeed CheckpointHiddenStatesOffload's keep_last_count: the newest input stays on the GPU
OFFLOAD_KEPT = 1


def offloaded_activation_bytes(spec: JobSpec, job: DerivedJob) -> int:
    """Pinned host bytes of `activation_checkpointing.offload: cpu` on one rank: one pinned buffer
    (power-of-2 rounded, memory/host_ram.pinned_bytes) per checkpointed layer's input but the
    newest, each micro-batch x this rank's share of the sequence x hidden size in the working
    precision."""
    setting = spec["memory"]["activation_checkpointing"]
    hidden = job.profile.inventory.hidden_size if job.profile is not None else None
    if not (isinstance(setting, dict) and setting["offload"] == "cpu") or not hidden:
        return 0
    tokens = job.micro_batch_size * math.ceil(job.seq_len / getattr(job, "sequence_parallel", 1))
    buffers = max(0, job.checkpointed_layers - OFFLOAD_KEPT)
    return buffers * host_memory.pinned_bytes(tokens * hidden * job.precision_bytes)


def kernels_note(spec: JobSpec) -> str:
    """What the trace of a `model.kernels: liger` job measured (model/kernel_stand_ins.py)."""
    text = ("model.kernels: liger: the activations are what Liger's kernels keep (each RMSNorm its "
            "input and an fp32 rstd per row, each MLP its two projections' outputs, not the "
            "activation's)")
    if fused_loss(spec):
        text += ("; the head's row is its fused linear cross-entropy: the hidden states' and the "
                 "head weight's gradients made in the forward, a chunk of tokens' logits at a time")
    return text


def weight_bytes(inventory: Inventory, lp: int,
                 quantization: JobSpecModelQuantization | None) -> int:
    """Bytes of every parameter's working copy: `lp` each, and for the weights bitsandbytes
    quantises (`inventory.quantized`) what it stores, as measured from bitsandbytes 0.49's
    QuantState on this box: 4-bit: the packed weights (n/2) + an absmax per block of 64 (fp32; with
    double quantisation uint8, plus an fp32 absmax per 256 blocks, a 256-entry fp32 code and an
    offset) + the 16-entry fp32 code; 8-bit (LLM.int8): an int8 weight + an fp32 scale per output
    row."""
    total = lp * inventory.total
    if not quantization or not inventory.quantized:
        return total
    for shape in inventory.quantized_shapes():
        n = math.prod(shape)
        total -= lp * n
        if quantization["bits"] == 8:
            total += n + 4 * shape[0]
            continue
        blocks = math.ceil(n / 64)
        total += math.ceil(n / 2) + 64
        total += blocks + 4 * math.ceil(blocks / 256) + 1024 + 4 if quantization["double_quant"] \
            else 4 * blocks
    return total


def _offload_extras(inventory: Inventory, memory: JobSpecMemory, stage: int, world: int, lp: int,
                    opt_states: int, accumulation: int, nvme: bool) -> dict[str, int]:
    """The optimizer offload's host buffers beyond master, states, fp32 gradients and stage 1/2's
    transfer buffer (`offloaded_optimizer`): see memory/host_ram.offload_terms for the DeepSpeed
    code."""
    trainable = [(shape, math.prod(shape)) for _, shape, train in inventory.tensors if train]
    # jobspec's two parameter groups (train/patches.parameter_groups): weight-decayed matrices, then
    # the undecayed norms and biases (1-D); ZeRO-3 forms sub-groups within each group
    partitions = [math.ceil(n / world) for shape, n in trainable if len(shape) > 1] + \
        [math.ceil(n / world) for shape, n in trainable if len(shape) <= 1]
    terms = host_memory.offload_terms(
        stage=stage, world=world, lp=lp, trainable=inventory.trainable, opt_states=opt_states,
        largest_param=max((n for _, n in trainable), default=0),
        sub_group_size=memory["zero"]["sub_group_size"],
        pinned=memory["offload"]["pin_memory"] and not nvme,
        partitions=partitions, accumulation_steps=accumulation)
    keep = ("offload_gradient_accumulation", "offload_temp_gradient", "pinned_rounding")
    return {k: v for k, v in terms.items() if k in keep and (stage == 3 or not nvme)}


def _persistent_params(inventory: Inventory, threshold: int) -> int:
    """ZeRO-3 keeps tensors of at most `threshold` elements whole on every rank (DeepSpeed's
    `ds_numel <= param_persistence_threshold`): norms, biases, tiny heads; with a threshold of 0,
    none."""
    if threshold <= 0:
        return 0
    return sum(n for n in (math.prod(shape) for _, shape, _ in inventory.tensors) if n <= threshold)


def _straddle(inventory: Inventory, world: int) -> int:
    """Elements of trainable parameters that overlap a rank's partition but lie outside it (worst
    rank), in the model's parameter order (DeepSpeed flattens them in that order)."""
    if world == 1:
        return 0
    sizes = [math.prod(shape) for shape in inventory.trainable_shapes()]
    size = math.ceil(sum(sizes) / world)
    edges = [(rank * size, (rank + 1) * size) for rank in range(world)]
    extra = [0] * world
    start = 0
    for n in sizes:
        end = start + n
        for rank, (lo, hi) in enumerate(edges):
            if start < hi and end > lo:
                extra[rank] += max(0, lo - start) + max(0, end - hi)
        start = end
    return max(extra)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


ROWS = (("parameters", "parameters (working copy)"), ("buffers", "buffers"),
        ("gradients", "gradients"),
        ("master_weights", "fp32 master weights"), ("optimizer_states", "optimizer states"),
        ("step_gradients", "fp32 gradients at step"),
        ("gathered_parameters", "ZeRO-3 gathered layers"),
        ("gradients_at_peak", "gradients made by the peak (traced)"),
        ("activations", "layer activations (traced)"),
        ("embeddings_activations", "embedding activations (traced)"),
        ("logits_and_loss", "head, logits and loss (traced)"),
        ("zero_buffers", "ZeRO buckets"),
        ("dequantized_weight", "dequantised weight (bitsandbytes)"),
        ("all_to_all_buffers", "Ulysses all-to-all buffers (one layer)"))

HOST_ROWS = (("runtime", "host: the rank's process"), ("construction", "host: model construction"),
             ("offloaded_optimizer", "host: offloaded optimizer"),
             ("offload_gradient_accumulation", "host: offload 16-bit gradients"),
             ("offload_temp_gradient", "host: offload gradient buffer"),
             ("pinned_rounding", "host: pinned power-of-2 rounding"),
             ("offloaded_parameters", "host: offloaded params"),
             ("offloaded_activations", "host: offloaded checkpoint inputs"),
             ("dataloader_workers", "host: data loader workers"),
             ("data_index", "host: data index (samples)"))


def render_plan(plan: MemoryPlan, title: str = "", advice: str | None = None) -> str:
    """The plain-text table `jobspec plan` prints; `advice`: what moves a plan over budget
    (memory/remedies.advice)."""
    s = plan.settings
    lines = [title] if title else []
    ckpt = f"{s['checkpointed_layers']}/{s['layers']} layers" if s["checkpointed_layers"] else "off"
    frozen = s["parameters"] - s["trainable_parameters"]
    trainable = f" ({s['trainable_parameters'] / 1e6:.1f}M trainable)" if frozen else ""
    lines.append(f"{s['parameters'] / 1e6:.1f}M params{trainable}, {s['precision']}, "
                 f"ZeRO-{s['zero_stage']} x {s['world_size']} rank(s), micro-batch "
                 f"{s['micro_batch_size']} x seq {s['seq_len']}, optimizer {s['optimizer']}, "
                 f"checkpointing {ckpt}, attention {s['attention']}, offload "
                 f"optimizer={s['offload_optimizer']} params={s['offload_params']}, tiled loss "
                 f"{s['tiled_loss']}, tiled MLP {'on' if s['tiled_mlp'] else 'off'}"
                 + (f", kernels {s['kernels']}" if s.get("kernels", "none") != "none" else ""))
    rows = [(label, plan.breakdown[key]) for key, label in ROWS if plan.breakdown[key]]
    totals = [("peak allocated", plan.peak_allocated),
              (f"peak reserved ({s['allocator']})", plan.peak_reserved),
              (f"GPU total incl. CUDA context ({s['cuda_context'].split(',')[0]})",
               plan.nvml_total)]
    if plan.nvme_total:
        totals.append(("NVMe per rank", plan.nvme_total))
    host_rows = [(label, plan.host[key]) for key, label in HOST_ROWS if plan.host.get(key)]
    host_totals = [("host RAM per rank", plan.host_total),
                   (f"host RAM per node ({plan.ranks_per_node} "
                    f"rank{'s' if plan.ranks_per_node > 1 else ''})",
                    plan.host_per_node)]
    width = max(len(label) for label, _ in rows + totals + host_rows + host_totals)
    for block in (rows, totals, host_rows, host_totals):   # a rule between the blocks
        if block is not rows:
            lines.append("-" * (width + 14))
        lines += [f"  {label:<{width}}  {fmt_mib_gib(value):>10}" for label, value in block]
    if plan.budget is not None and plan.headroom is not None:   # both or neither
        verdict = "fits" if plan.gpu_fits else "does NOT fit"
        lines.append(f"{verdict} in {fmt_mib_gib(plan.budget)}: headroom "
                     f"{fmt_mib_gib(plan.headroom)}")
        if advice is not None:
            lines.append(f"advice: {advice}")
    if plan.host_budget is not None:
        verdict = "fits" if plan.host_fits else "does NOT fit"
        lines.append(f"host: {verdict} in {fmt_mib_gib(plan.host_budget)} per node: headroom "
                     f"{fmt_mib_gib(plan.host_budget - plan.host_per_node)}")
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(f"note: CUDA context {s['cuda_context']}")
    return "\n".join(lines)
