"""`--fit`: the fastest settings the memory planner predicts to fit a per-GPU budget.

The global batch (and so the training trajectory) never changes. The search plans every combination
of the knobs below, prices each with a step-time model (docs/memory-planner.md, "Slowdown model")
and returns the cheapest one that fits, as `--set` overrides plus a one-line reason:

  micro-batch down / accumulation up, bf16 (fp16 where bf16 is unsupported), checkpointing one layer
  in k (k down to 1), 8-bit AdamW, a higher ZeRO stage, CPU optimizer offload, CPU parameter
  offload, NVMe offload (only when `memory.offload.nvme_path` is set); for causal LMs the
  long-sequence techniques on top of checkpointing every layer, in order of cost: the tiled loss,
  the tiled MLP, the checkpointed inputs offloaded to the host (their recomputes are in the traced
  FLOPs, the offload's copies in PCIe time).
Pure: no torch, no I/O.
"""
from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jobspec import optimizers, techniques
from jobspec.errors import SpecError, spec_error
from jobspec.memory.gpu_overheads import ContextFigure
from jobspec.memory.gpu_throughput import GpuReadings, precision_key, readings_for
from jobspec.memory.planner import MemoryPlan, plan_memory
from jobspec.optimizers.base import DEEPSPEED_CPU_ADAM
from jobspec.spec.derived import DerivedJob
from jobspec.spec.schema import filled_spec
from jobspec.spec.types import JobSpec
from jobspec.units import fmt_mib_gib

# Reference device of the slowdown model for a GPU without readings (memory/gpu_throughput.py): it
# ranks the candidates; the tokens/s it implies is an A100-class guess, said as such.
EFFECTIVE_FLOPS = {"fp32": 15e12, "bf16": 40e12, "fp16": 40e12}   # achieved, not peak (A100-class)
HALF_SATURATION_TOKENS = 1024   # tokens per micro-batch at which the GPU runs at half its best rate
PCIE_BYTES_PER_S = 12e9         # host <-> GPU, pinned
INTERCONNECT_BYTES_PER_S = 50e9  # GPU <-> GPU all-gathers of ZeRO-3
NVME_BYTES_PER_S = 3e9
CPU_ADAM_PARAMS_PER_S = 0.5e9   # DeepSpeedCPUAdam on a typical host
CHECKPOINT_EVERY = (8, 6, 4, 3, 2, 1)
# The long-sequence techniques (docs/memory-planner.md), each level adding one: tried with every
# layer checkpointed, the first thing a long sequence needs
# their registry's FitSteps, by cost
TECHNIQUES = tuple(step.key for step in techniques.fit_steps())
# DeepSpeed copies checkpoint inputs on a side stream: half hidden behind compute
OFFLOAD_OVERLAP = 0.5
# Achieved training FLOP/s of one CPU core (fp32 or bf16, one thread per core): 50-80 GFLOP/s
# measured for encoder steps with hidden sizes 256-1024 on an AMD EPYC core (docs/benchmarks.md,
# "CPU ranks"); the low end, as a loaded machine and DeepSpeed's overhead only slow a step down.
CPU_FLOPS_PER_CORE = 50e9


@dataclass
class FitResult:
    fits: bool
    overrides: list          # `--set` arguments turning the spec into the chosen configuration
    changes: dict            # dotted path -> new value
    plan: MemoryPlan         # the chosen configuration's plan (the smallest one when nothing fits)
    slowdown: float          # estimated step time relative to the spec as written
    reason: str
    considered: int = 0
    notes: list = field(default_factory=list)
    host_limited: bool = False   # configurations fit the GPU, none of them the host budget
    speed: Speed | None = None   # the chosen configuration's estimated step time and tokens/s

    def as_dict(self) -> dict:
        return {"fits": self.fits, "overrides": self.overrides, "changes": self.changes,
                "slowdown": round(self.slowdown, 3), "reason": self.reason,
                "considered": self.considered,
                "notes": self.notes, "host_limited": self.host_limited, "plan": self.plan.as_dict(),
                "speed": self.speed.as_dict() if self.speed is not None else None}


@dataclass(frozen=True)
class Speed:
    """A configuration's estimated step time and the tokens/s it trains at (all ranks), and where
    the GPU's speed comes from: its readings (memory/gpu_throughput.py) or the reference formula."""

    step_s: float
    tokens_per_s: float
    source: str

    def as_dict(self) -> dict:
        return {"step_s": round(self.step_s, 4), "tokens_per_s": round(self.tokens_per_s),
                "source": self.source}

    def text(self) -> str:
        tokens = f"{self.tokens_per_s:,.0f}"
        return f"est. {tokens} tokens/s, {self.step_s:.3g} s per step, {self.source}"


def fit(spec: JobSpec, job: DerivedJob, budget_bytes: int, *, bf16_supported: bool = True,
        host_budget: int | None = None, context: ContextFigure | None = None,
        gpu: str | None = None) -> FitResult:
    """The fastest configuration of `spec` predicted to fit `budget_bytes` per GPU (NVML-style
    total) and, when `host_budget` is known, a node's RAM with all its ranks; `context`: the GPU's
    CUDA context (planner.plan_memory); `gpu`: its name, whose readings price the step
    (step_time)."""
    result = _search(spec, job, budget_bytes, bf16_supported, host_budget, context, gpu)
    if result.fits:
        chosen = apply_changes(spec, result.changes)
        result.speed = speed_of(chosen, job.with_spec(chosen), gpu)
        result.notes.append(compile_note(chosen, job, result.speed, gpu))
    return result


def _search(spec: JobSpec, job: DerivedJob, budget_bytes: int, bf16_supported: bool,
            host_budget: int | None, context: ContextFigure | None, gpu: str | None) -> FitResult:
    """`fit`'s search over the candidates, priced relative to the spec as written."""
    baseline = step_time(spec, job, gpu)
    best, gpu_best, smallest, host_least, considered = None, None, None, None, 0
    for changes in candidate_changes(spec, job, bf16_supported):
        candidate = apply_changes(spec, changes)
        candidate_job = job.with_spec(candidate)
        plan = plan_memory(candidate, candidate_job, budget=budget_bytes, host_budget=host_budget,
                           context=context)
        considered += 1
        cost = step_time(candidate, candidate_job, gpu) / baseline
        if smallest is None or plan.nvml_total < smallest[1].nvml_total:
            smallest = (changes, plan, cost)
        entry = (changes, plan, cost)
        def faster(held: tuple[dict, MemoryPlan, float] | None) -> bool:
            return held is None or (cost, len(changes)) < (held[2], len(held[0]))

        if plan.gpu_fits and faster(gpu_best):
            gpu_best = entry
        if plan.gpu_fits and (host_least is None or plan.host_total < host_least[1].host_total):
            host_least = entry
        if plan.fits and faster(best):
            best = entry
    notes = []
    if not spec["memory"]["offload"]["nvme_path"]:
        notes.append("NVMe offload not tried: set memory.offload.nvme_path to include it")
    if gpu_best is not None and gpu_best is not best and host_budget is not None:
        # the fastest GPU fit overflows the node's RAM (typically its CPU offload buffers): say so
        changes, plan, cost = gpu_best
        notes.append(f"{describe(changes)} fits the GPU (est. {cost:.2f}x step time) but needs "
                     f"{fmt_mib_gib(plan.host_per_node)} of host RAM per node "
                     f"({plan.ranks_per_node} x {fmt_mib_gib(plan.host_total)}), more than "
                     f"{fmt_mib_gib(host_budget)}")
    if best is None and host_least is not None and host_budget is not None:
        changes, plan, cost = host_least
        reason = (f"nothing fits both {fmt_mib_gib(budget_bytes)} per GPU and "
                  f"{fmt_mib_gib(host_budget)} of host RAM per node: the configuration that fits "
                  f"the GPU with the least host RAM ({describe(changes)}) needs "
                  f"{fmt_mib_gib(plan.host_per_node)} per node ({plan.ranks_per_node} x "
                  f"{fmt_mib_gib(plan.host_total)})")
        return FitResult(False, to_overrides(changes), changes, plan, cost, reason, considered,
                         notes, host_limited=True)
    if best is None:
        if smallest is None:
            raise ValueError("fit: no configuration to consider")
        changes, plan, cost = smallest
        reason = (f"nothing fits in {fmt_mib_gib(budget_bytes)}: the smallest configuration "
                  f"({describe(changes)}) needs {fmt_mib_gib(plan.nvml_total)}. Try "
                  f"{_what_else(spec)}")
        return FitResult(False, to_overrides(changes), changes, plan, cost, reason, considered,
                         notes)
    changes, plan, cost = best
    reason = (f"{describe(changes)}: {fmt_mib_gib(plan.nvml_total)} of "
              f"{fmt_mib_gib(budget_bytes)}, est. {cost:.2f}x step time")
    if host_budget is not None:
        reason += f"; host {fmt_mib_gib(plan.host_per_node)} per node of {fmt_mib_gib(host_budget)}"
    return FitResult(True, to_overrides(changes), changes, plan, cost, reason, considered, notes)


def _what_else(spec: JobSpec) -> str:
    """What a job none of whose configurations fits can still change, among what validation
    accepts."""
    if spec["model"]["quantization"] is not None:   # a 4-bit base: ZeRO 0-2 keep its weights whole
        options = ["more GPUs (ZeRO 1-2 divide the adapters' states by the world size)"]
    else:
        options = ["more GPUs (ZeRO-3 divides the model states by the world size)"]
    if spec["model"]["compile"]:
        options.append("`model.compile: false` (ZeRO-3, the tiled MLP and offloaded inputs are "
                       "refused with it)")
    if spec["model"]["task"] == "causal-lm":
        options.append("a shorter sequence (`jobspec plan --longest` finds the longest that fits)")
    if not spec["memory"]["offload"]["nvme_path"]:
        options.append("NVMe offload (memory.offload.nvme_path)")
    return ", ".join(options) + ", or a smaller model"


def candidate_changes(spec: JobSpec, job: DerivedJob,
                      bf16_supported: bool) -> Iterator[dict[str, Any]]:
    """Every combination of knob settings, as {dotted path: value} relative to `spec`."""
    training, memory = spec["training"], spec["memory"]
    # the batch split counts data-parallel ranks: world / memory.sequence_parallel
    micro, global_batch, world = job.micro_batch_size, job.global_batch_size, job.data_parallel_size
    micros = [m for m in range(micro, 0, -1) if micro % m == 0 and global_batch % (m * world) == 0]
    half = "bf16" if bf16_supported else "fp16"
    precisions = [memory["precision"]] + ([half] if memory["precision"] == "fp32" else [])
    # one layer in k, for the k validation accepts (at most the model's layers)
    layers = job.num_layers or 0
    checkpointing = [False] \
        + [{"every_n_layers": k} for k in CHECKPOINT_EVERY if 1 < k <= layers] + [True]
    names = [training["optimizer"]["name"],
             *optimizers.get(training["optimizer"]["name"]).fit_alternatives]
    nvme = bool(memory["offload"]["nvme_path"])
    layouts = [(stage, "none", "none") for stage in range(memory["zero_stage"], 4)]
    for stage in range(max(1, memory["zero_stage"]), 4):
        layouts.append((stage, "cpu", "none"))
        if nvme:
            layouts.append((stage, "nvme", "none"))
    layouts += [(3, "cpu", "cpu")] + ([(3, "nvme", "nvme"), (3, "nvme", "cpu")] if nvme else [])
    current_layout = (memory["zero_stage"], memory["offload"]["optimizer"],
                      memory["offload"]["params"])
    if current_layout not in layouts:
        layouts.insert(0, current_layout)
    levels = technique_levels(spec)
    for m, precision, ckpt, optimizer, layout, level in itertools.product(
            micros, precisions, checkpointing, names, layouts, levels):
        if level and ckpt is not True:
            continue   # the techniques come after checkpointing every layer
        stage, off_opt, off_params = layout
        if optimizers.get(optimizer).offload != DEEPSPEED_CPU_ADAM and off_opt != "none":
            continue   # the fast optimizer offload is DeepSpeed's own CPU Adam
        pinned = training["optimizer"]["implementation"]
        if (pinned == "fused" and off_opt != "none") or (pinned == "cpu" and off_opt == "none"):
            continue   # a pinned Adam implementation fixes whether the optimizer is offloaded
        if spec["model"]["attention"] == "flash_attention_2" and precision == "fp32":
            continue
        if spec["model"]["quantization"] is not None \
                and (stage != memory["zero_stage"] or off_params != "none"):
            # a quantised base's packed weights stay where the job put them: the fit changes its
            # micro-batch, checkpointing, precision and optimizer offload, not how the bitsandbytes
            # weights are sharded
            continue
        wanted = {"training.micro_batch_size": m, "memory.precision": precision,
                  "memory.activation_checkpointing": _normal_ckpt(ckpt),
                  "training.optimizer.name": optimizer,
                  "memory.zero_stage": stage, "memory.offload.optimizer": off_opt,
                  "memory.offload.params": off_params}
        steps = [step for step in techniques.fit_steps() if step.key in level]
        for step in steps:
            wanted.update(step.changes)
        if spec["model"]["compile"] and stage == 3:
            # validation refuses ZeRO-3 under model.compile (techniques/regional_compile.py)
            continue
        if any(step.refused(spec, wanted) for step in techniques.fit_steps()
               if step in steps or step.is_on(spec)):
            # validation refuses the technique beside this candidate (its module says why)
            continue
        changes = {k: v for k, v in wanted.items()
                   if _normal_ckpt(_get(spec, k)) != _normal_ckpt(v)}
        if "training.micro_batch_size" in changes and training["global_batch_size"] is None:
            changes["training.global_batch_size"] = global_batch
        yield changes


def technique_levels(spec: JobSpec) -> list[tuple]:
    """The long-sequence technique sets to try: none, then one more at a time (causal LMs: the tasks
    whose head tiles); a technique the spec already has stays on."""
    if spec["model"]["task"] != "causal-lm":
        return [()]
    steps = techniques.fit_steps()
    on = [step.key for step in steps if step.is_on(spec)]
    # a technique its module says fit may not try here (the tiled loss beside Liger's fused loss)
    keys = [step.key for step in steps if step.available(spec)]
    levels = [tuple(keys[:n]) for n in range(len(keys) + 1)]
    return [level for level in levels if all(key in level for key in on)]


def _normal_ckpt(value: Any) -> Any:
    """Checkpointing settings compared by meaning: `{every_n_layers: 1}` is `true`; an offload is
    kept."""
    if isinstance(value, dict):
        every = value.get("every_n_layers", 1)
        if value.get("offload", "none") == "cpu":
            return {"every_n_layers": every, "offload": "cpu"}
        return True if every == 1 else {"every_n_layers": every}
    return value


def _get(spec: JobSpec, dotted: str) -> Any:
    node: Any = spec   # a dotted path of the search's changes: any field
    for key in dotted.split("."):
        node = node[key]
    return node


def apply_changes(spec: JobSpec, changes: dict) -> JobSpec:
    """A copy of `spec` with `changes` ({dotted path: value}) set, defaults filled: a change writes
    only what it changes (`{every_n_layers: 2}`), the loader's defaults fill the rest of that
    object."""
    out = copy.deepcopy(spec)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node: Any = out
        for key in parents:
            node = node[key]
        node[last] = copy.deepcopy(value)
    return filled_spec(out)


def to_overrides(changes: dict) -> list:
    """`--set` arguments: YAML values (`{every_n_layers: 2}`, `true`, `bf16`)."""
    def text(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in value.items()) + "}"
        return json.dumps(value) if not isinstance(value, str) else value
    return [f"{dotted}={text(value)}" for dotted, value in changes.items()]


_STEP_WORDS = {step.key: step.words for step in techniques.fit_steps()}


def describe(changes: dict) -> str:
    if not changes:
        return "as written"
    words = []
    for dotted, value in changes.items():
        if dotted == "training.global_batch_size":
            continue
        if dotted == "training.micro_batch_size":
            words.append(f"micro-batch {value}")
        elif dotted == "memory.precision":
            words.append(value)
        elif dotted == "memory.activation_checkpointing":
            offload = isinstance(value, dict) and value.get("offload") == "cpu"
            every = value.get("every_n_layers", 1) if isinstance(value, dict) else 1
            words.append("no checkpointing" if value is False else
                         ("checkpoint every layer" if every == 1
                          else f"checkpoint every {every} layers") +
                         (", inputs offloaded to the host" if offload else ""))
        elif dotted in _STEP_WORDS:
            words.append(_STEP_WORDS[dotted])
        elif dotted == "training.optimizer.name":
            words.append(optimizers.get(value).label or value)
        elif dotted == "memory.zero_stage":
            words.append(f"ZeRO-{value}")
        elif dotted == "memory.offload.optimizer":
            words.append(f"optimizer offload {value}")
        elif dotted == "memory.offload.params":
            words.append(f"parameter offload {value}")
    return " + ".join(words)


def host_refusal(spec: JobSpec, job: DerivedJob, plan: MemoryPlan, source: str) -> SpecError:
    """Exit 2 at `resources.host_mem` for a plan whose node does not hold its ranks' host memory:
    the numbers, the largest part, and the changes (each replanned) that bring it within the
    budget."""
    budget = plan.host_budget
    if budget is None:
        raise ValueError("host_refusal needs a plan with a host budget")
    parts = ", ".join(f"{key.replace('_', ' ')} {fmt_mib_gib(value)}"
                      for key, value in plan.host.items() if value)
    message = (f"the plan needs {fmt_mib_gib(plan.host_per_node)} of host RAM per node "
               f"({plan.ranks_per_node} rank{'s' if plan.ranks_per_node > 1 else ''} x "
               f"{fmt_mib_gib(plan.host_total)}: {parts}), more than the {fmt_mib_gib(budget)} of "
               f"{source}")
    fixes = host_remedies(spec, job, budget)
    need = f"a node with at least {fmt_mib_gib(plan.host_per_node)} of RAM (resources.host_mem)"
    return spec_error(message, path=("resources", "host_mem"), hint="; ".join([*fixes, need]))


def host_remedies(spec: JobSpec, job: DerivedJob, host_budget: int) -> list[str]:
    """The single changes (each planned again) after which a node holds its ranks' host memory."""
    memory = spec["memory"]
    tries: list[tuple[dict[str, object], str]] = []
    if memory["zero_stage"] < 3:
        tries.append(({"memory.zero_stage": 3}, "ZeRO-3 builds only each rank's partition"))
    if memory["offload"]["optimizer"] != "none" or memory["offload"]["params"] != "none":
        tries.append(({"memory.offload.optimizer": "none", "memory.offload.params": "none"},
                      "no CPU offload buffers"))
        if memory["offload"]["nvme_path"] and memory["offload"]["optimizer"] == "cpu":
            tries.append(({"memory.offload.optimizer": "nvme"}, "optimizer states on NVMe"))
    if spec["data"]["num_workers"]:
        tries.append(({"data.num_workers": 0}, "no data loader workers"))
    found = []
    for changes, why in tries:
        candidate = apply_changes(spec, changes)
        plan = plan_memory(candidate, job.with_spec(candidate), host_budget=host_budget)
        if plan.host_fits:
            found.append(f"{' '.join(f'--set {o}' for o in to_overrides(changes))} ({why}: "
                         f"{fmt_mib_gib(plan.host_per_node)} per node, "
                         f"{fmt_mib_gib(plan.nvml_total)} per GPU)")
    return found


def step_time(spec: JobSpec, job: DerivedJob, gpu: str | None = None) -> float:
    """Estimated seconds per optimizer step on the GPU named `gpu` where it has readings, else on
    the reference device (docs/memory-planner.md, "Slowdown model")."""
    memory = spec["memory"]
    plan = plan_memory(spec, job)
    psi, world = plan.settings["parameters"], job.world_size
    tokens = job.tokens_per_micro_batch
    if job.hardware_flops_per_token is None:
        # set whenever the job has a profile, which plan_memory above requires
        raise ValueError("step_time needs the model's traced FLOPs")
    # the traced FLOPs per token, checkpoint recompute included
    flops = job.hardware_flops_per_token * tokens
    compute = flops / achieved_flops(spec, job, readings_for(gpu))
    lp = job.precision_bytes
    shard = psi / world
    per_micro = compute
    if memory["zero_stage"] == 3 and world > 1:
        # half overlapped
        per_micro += 2 * lp * psi * (world - 1) / world / INTERCONNECT_BYTES_PER_S * 0.5
    offload_params = memory["offload"]["params"]
    if offload_params != "none":
        speed = PCIE_BYTES_PER_S if offload_params == "cpu" else NVME_BYTES_PER_S
        per_micro += 2 * lp * shard / speed
    # out and back
    per_micro += OFFLOAD_OVERLAP * 2 * _offloaded_bytes(spec, job) / PCIE_BYTES_PER_S
    step = per_micro * job.gradient_accumulation_steps
    offload_opt = memory["offload"]["optimizer"]
    if offload_opt != "none":
        step += 2 * lp * shard / PCIE_BYTES_PER_S + shard / CPU_ADAM_PARAMS_PER_S
        if offload_opt == "nvme":
            step += 2 * 16 * shard / NVME_BYTES_PER_S
    step *= 1 + optimizers.get(spec["training"]["optimizer"]["name"]).step_overhead
    return step


def achieved_flops(spec: JobSpec, job: DerivedJob, measured: GpuReadings | None) -> float:
    """Hardware FLOP/s of one micro-batch: the GPU's readings (memory/gpu_throughput.py), else the
    reference formula (EFFECTIVE_FLOPS at tokens / (tokens + HALF_SATURATION_TOKENS))."""
    memory, tokens = spec["memory"], job.tokens_per_micro_batch
    hidden = job.profile.inventory.hidden_size if job.profile is not None else None
    if measured is not None and hidden:
        precision = precision_key(memory["precision"], memory["tf32"])
        return measured.achieved_flops(precision, tokens, hidden)
    return EFFECTIVE_FLOPS[memory["precision"]] * tokens / (tokens + HALF_SATURATION_TOKENS)


def speed_of(spec: JobSpec, job: DerivedJob, gpu: str | None) -> Speed:
    """The estimated step time of `spec` on the GPU named `gpu`, the tokens/s it trains at over
    every rank (the global batch's tokens per step), and where the GPU's speed comes from."""
    seconds = step_time(spec, job, gpu)
    measured = readings_for(gpu)
    if measured is not None:
        source = f"measured on {measured.gpu} ({measured.source})"
    elif gpu:
        source = f"no readings for {gpu}: the reference formula (an A100-class guess)"
    else:
        source = "the reference formula (an A100-class guess; `--gpu H200` uses its readings)"
    return Speed(seconds, job.global_batch_size * job.seq_len / seconds, source)


def compile_note(spec: JobSpec, job: DerivedJob, speed: Speed, gpu: str | None) -> str:
    """When `model.compile` pays for this job: its compile time against what faster steps save over
    the job's steps (the GPU's measured compile time and speed-up where it has them)."""
    said = f"model.compile ({'on' if spec['model']['compile'] else 'off'})"
    steps = job.total_steps
    if not steps:
        return f"{said} pays when its compile time is less than what it saves over the job's steps"
    run_s = steps * speed.step_s
    measured = readings_for(gpu)
    if measured is not None and measured.compile is not None:
        compile_s, speedup = measured.compile
        saved = run_s * (1 - 1 / speedup)
        verdict = "pays" if saved > compile_s else "does not pay"
        return (f"{said} {verdict} here: measured on {measured.gpu}, {compile_s:.0f} s of "
                f"compilation in the first step and steps {speedup:.2f}x as fast, which saves est. "
                f"{_duration(saved)} of the {steps} steps' {_duration(run_s)}")
    where = measured.gpu if measured is not None else gpu or "this GPU"
    return (f"{said} pays when its compile time (paid in the first step; launcher.log's "
            f"`torch.compile` note says it) is less than it saves: the {steps} steps take est. "
            f"{_duration(run_s)}, so a 10% faster step saves {_duration(run_s / 10)}; no measured "
            f"compile time or speed-up for {where} (python -m bench gpu-throughput measures them)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _offloaded_bytes(spec: JobSpec, job: DerivedJob) -> int:
    """Bytes the checkpoint-input offload copies each way per micro-batch (unrounded)."""
    setting = spec["memory"]["activation_checkpointing"]
    hidden = job.profile.inventory.hidden_size if job.profile is not None else None
    if not (isinstance(setting, dict) and setting["offload"] == "cpu") or not hidden:
        return 0
    layers = max(0, job.checkpointed_layers - 1)
    return layers * job.tokens_per_micro_batch * hidden * job.precision_bytes


def cpu_step_time(job: DerivedJob, cpus: int) -> float | None:
    """Estimated seconds per optimizer step when the job's ranks share `cpus` CPU cores; None when
    the FLOPs per token are unknown. Every rank's work (the global batch, checkpoint recompute
    included) divided by the cores: CPU ranks are compute-bound, their all-reduces are in memory."""
    if not job.hardware_flops_per_token:
        return None
    tokens = job.global_batch_size * job.seq_len
    return job.hardware_flops_per_token * tokens / (max(1, cpus) * CPU_FLOPS_PER_CORE)


LONGEST_STEP = 64          # the lengths --longest reports are multiples of this many tokens
LONGEST_CAP = 1 << 20      # the search's ceiling when the model's positions are unknown


@dataclass
class Longest:
    """`jobspec plan --longest`: the longest sequence that fits, and its plan (None: not even one
    step)."""

    seq_len: int | None
    plan: MemoryPlan | None
    # the longest the search tried (the model's positions, or LONGEST_CAP)
    ceiling: int
    planned: int = 0           # sequence lengths planned
    # what the next length runs out of: "gpu" (the GPU budget; also when the host's runs out
    # there too), "host" (the node's RAM: offloaded checkpoint inputs, CPU offload buffers) or
    # "positions" (the answer is the ceiling)
    binding: str = "gpu"

    def as_dict(self) -> dict:
        return {"seq_len": self.seq_len, "ceiling": self.ceiling, "planned": self.planned,
                "binding": self.binding,
                "plan": self.plan.as_dict() if self.plan is not None else None}


def seq_len_path(spec: JobSpec) -> str:
    """The field that sets the sequence length: synthetic data's, else `data.max_length`."""
    return "data.synthetic.seq_len" if spec["data"].get("synthetic") else "data.max_length"


def longest_sequence(spec: JobSpec, job: DerivedJob, budget_bytes: int, *,
                     host_budget: int | None = None, changes: dict | None = None) -> Longest:
    """The longest sequence (a multiple of LONGEST_STEP, up to the model's positions) whose plan
    fits the GPU budget and, when known, the node's RAM, for `spec` with `changes` applied (the
    fitted configuration) and everything else as written. Planned lengths: doubling from the written
    one (or halving when it does not fit), then bisection; activations grow with the sequence, so
    the verdicts are monotone (tests/model/test_length_interpolation.py checks it). `binding`: what
    the next length runs out of."""
    base = apply_changes(spec, changes or {})
    positions = job.dims.max_position_embeddings if job.dims is not None else None
    ceiling = max(LONGEST_STEP, (positions or LONGEST_CAP) // LONGEST_STEP * LONGEST_STEP)
    plans: dict[int, MemoryPlan] = {}

    def plan_at(length: int) -> MemoryPlan:
        if length not in plans:
            candidate = apply_changes(base, {seq_len_path(base): length})
            plans[length] = plan_memory(candidate, job.with_spec(candidate), budget=budget_bytes,
                                        host_budget=host_budget)
        return plans[length]

    def fits(length: int) -> bool:
        return bool(plan_at(length).fits)

    def found(length: int | None) -> Longest:
        if length == ceiling:
            return Longest(length, plan_at(length), ceiling, len(plans), "positions")
        over = plan_at(LONGEST_STEP if length is None else length + LONGEST_STEP)
        binding = "host" if over.gpu_fits is not False and over.host_fits is False else "gpu"
        plan = plan_at(length) if length is not None else None
        return Longest(length, plan, ceiling, len(plans), binding)

    start = min(ceiling, max(LONGEST_STEP, job.seq_len // LONGEST_STEP * LONGEST_STEP))
    if fits(start):
        low, high = start, None
        while high is None and low < ceiling:
            nxt = min(ceiling, low * 2)
            if fits(nxt):
                low = nxt
            else:
                high = nxt
        if high is None:
            return found(low)
    else:
        high, low = start, None
        while low is None and high > LONGEST_STEP:
            nxt = max(LONGEST_STEP, high // 2 // LONGEST_STEP * LONGEST_STEP)
            if fits(nxt):
                low = nxt
            else:
                high = nxt
        if low is None:
            return found(None)
    assert low is not None and high is not None   # each branch above returns or sets both
    while high - low > LONGEST_STEP:
        middle = (low + high) // 2 // LONGEST_STEP * LONGEST_STEP
        if fits(middle):
            low = middle
        else:
            high = middle
    return found(low)
