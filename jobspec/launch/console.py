"""What `jobspec launch` tells its user: the header before anything starts and the closing summary.

Pure: the resolved spec, its DerivedJob, the launch's memory decisions, the host found, the compiled
patches, summary.json and the MLflow run record in; lines of text out. Numbers come from those
inputs as they are (the derived job, the planner, the worker's summary), never recomputed here.
`style=True` (a terminal, the progress bar's mode) makes the labels bold; the words are the same.
"""
from __future__ import annotations

import json
import os
import re
from urllib.parse import urlsplit

from jobspec import optimizers, techniques
from jobspec.compile.compiler import patch_text
from jobspec.memory import plan_figures
from jobspec.memory.plan_figures import GPU_TOTAL, HOST_RAM, PEAK_ALLOCATED
from jobspec.memory.planner import ALLOCATOR_VARIABLE, allocator_conf, expandable
from jobspec.rundir import RunSummary
from jobspec.spec.types import JobSpec, JobSpecModel
from jobspec.tasks import metrics as eval_metrics
from jobspec.techniques.lora import random_base_note
from jobspec.units import MiB, fmt_mib_gib

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "Sized for GPUs" (said when such a job runs on CPU ranks): the planner's time per step on this
# host's cores above this, or the plan's memory for the node's ranks above the host's available RAM.
CPU_STEP_LIMIT_S = 10.0
MLFLOW_UI = "http://127.0.0.1:5000"   # where `mlflow ui` serves by default


# --- formatting ----------------------------------------------------------------------------------

def fmt_count(n: int | float | None) -> str:
    if n is None:
        return "?"
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def fmt_mib(mib: float | None) -> str:
    return "?" if mib is None else fmt_mib_gib(mib * MiB)


def label(name: str, style: bool) -> str:
    text = f"  {name:<12}"
    return f"\x1b[1m{text}\x1b[0m" if style else text


def _title(text: str, style: bool) -> str:
    return f"\x1b[1mjobspec: {text}\x1b[0m" if style else f"jobspec: {text}"


def plain(lines: list[str]) -> str:
    """The block without terminal styling (summary.json, the MLflow run description)."""
    return "\n".join(ANSI.sub("", line) for line in lines)


# --- MLflow ------------------------------------------------------------------------------------

def mlflow_open(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """How to look at the run: its URL on a tracking server, or the `mlflow ui` command for a local
    store."""
    parts = urlsplit(tracking_uri)
    # MLflow 3's UI opens in its GenAI mode unless told (a `workflowType` query parameter, else the
    # browser's last choice, by default GenAI), where a run is filed under "Evaluations" and its
    # model metrics are hidden; `machine_learning` opens the run page of model training
    page = f"/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    if parts.scheme in ("http", "https"):
        return tracking_uri.rstrip("/") + page
    if parts.scheme in ("sqlite", "file", ""):
        store = _absolute_store(tracking_uri)
        return f"mlflow ui --backend-store-uri {store}  then  {MLFLOW_UI}{page}"
    return f"run {run_id} in experiment {experiment_id} at {tracking_uri}"


def _absolute_store(uri: str) -> str:
    """sqlite:///mlflow.db is relative to where jobspec ran: make it work from any directory."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    if "://" not in uri:
        return os.path.abspath(uri)
    return uri


def tracking_lines(info: dict | None, experiment: str | None = None, *,
                   style: bool = False) -> list[str]:
    if not info:
        return []
    named = f" in experiment {experiment!r}" if experiment else ""
    return [label("MLflow", style) + f"run {info['run_id']}{named}",
            label("", style)
            + mlflow_open(info["tracking_uri"], info["experiment_id"], info["run_id"])]


# --- the header ----------------------------------------------------------------------------------

def header_lines(spec: JobSpec, job, memory, host, patches: list, *,
                 style: bool = False) -> list[str]:
    """The lines printed before anything starts. `job`: DerivedJob; `memory`:
    memory.at_launch.LaunchMemory; `host`: hardware.Host; `patches`: the compiled patches.json
    entries."""
    model = spec["model"]
    name = model["name_or_path"] or model["architecture"] or "?"
    lines = [_title(f"{spec['name']}: {name} {model['task']}, {fmt_count(job.num_parameters)} "
                    "parameters", style)]
    mem = spec["memory"]
    offload = [f"{what} to {where}" for what, where in (("optimizer", mem["offload"]["optimizer"]),
                                                         ("parameters", mem["offload"]["params"]))
               if where != "none"]
    accumulation = f" x {job.gradient_accumulation_steps} accumulation" \
        if job.gradient_accumulation_steps > 1 else ""
    lines.append(label("training", style) + f"{job.precision} · ZeRO-{mem['zero_stage']} · "
                 f"{'offload ' + ', '.join(offload) if offload else 'no offload'} · global batch "
                 f"{job.global_batch_size} ({job.micro_batch_size} per rank x "
                 f"{_ranks(job.world_size)}{accumulation}) · "
                 f"{job.total_steps} steps · sequence length {job.seq_len}")
    lines.append(label("hardware", style) + hardware_text(job, host))
    if memory.plan is None or not memory.plan.cpu_ranks:   # CPU ranks: their tensors are host RAM
        lines.append(label("memory", style) + memory_text(memory, host))
    if memory.plan is not None:
        lines.append(label(HOST_RAM.label, style) + host_memory_text(memory, host))
    if memory.host_problem is not None:   # memory.fit: auto refused it already; as written, say so
        issue = memory.host_problem.issues[0]
        lines.append(f"WARNING: the nodes cannot hold this job: {issue.message}.")
        lines.append(f"  It may be killed by the kernel's OOM killer. Change: {issue.hint}; "
                     "memory.fit: auto refuses such a launch.")
    described = [patch_text(p) for p in patches]
    if not optimizers.get(spec["training"]["optimizer"]["name"]).built_by_deepspeed:
        # the ranks build it (train/patches.client_optimizer): said where its patch used to be
        later = [i for i, p in enumerate(patches)
                 if p["name"] in techniques.BY_NAME and techniques.get(p["name"]).after_base]
        described.insert(later[0] if later else len(described),
                         f"optimizer {spec['training']['optimizer']['name']}, built by jobspec")
    if described:
        lines.append(label("model", style) + " · ".join(d for d in described if d))
    base_note = random_base_note(spec)
    if base_note:
        lines.append(label("note", style) + base_note)
    return lines


def allocator_text(environ) -> str:
    """The CUDA allocator the GPU ranks run (launch/pipeline.child_env sets it, the plan models
    it)."""
    conf, chosen = allocator_conf(environ)
    if chosen:
        return (f"allocator {ALLOCATOR_VARIABLE}={conf} (set by jobspec; set the variable to "
                "choose another)")
    modelled = "expandable segments" if expandable(conf) \
        else "no expandable segments: the plan assumes them"
    return f"allocator {ALLOCATOR_VARIABLE}={conf} (yours; {modelled})"


def hardware_text(job, host) -> str:
    per_node = job.gpus_per_node
    nodes = f" per node x {job.nodes} nodes" if job.nodes > 1 else ""
    if host.has_gpu:
        names = sorted(set(host.gpu_names))
        ranks = f"{per_node} rank{'s' if per_node > 1 else ''}{nodes}"
        return (f"{', '.join(names)} x {len(host.gpu_names)} on this host; "
                f"world size {job.world_size} ({ranks})")
    return f"no GPU: {per_node} CPU {_ranks(per_node).split(' ', 1)[1]}{nodes} on {host.cpus} " \
           f"CPU core{'s' if host.cpus != 1 else ''}; world size {job.world_size}"


def memory_text(memory, host) -> str:
    """The plan's GPU figures (memory/plan_figures: GPU total, peak allocated) against the GPU."""
    plan = memory.plan
    if plan is None:
        return "no plan for this model (see the line above)"
    allocated = fmt_mib_gib(plan.peak_allocated)
    text = (f"{GPU_TOTAL.label} plan {fmt_mib_gib(plan.nvml_total)} per GPU "
            f"({PEAK_ALLOCATED.label} {allocated} + allocator and CUDA context)")
    if host.has_gpu and host.gpu_free is not None:
        verdict = "fits" if plan.nvml_total <= host.gpu_free else "DOES NOT FIT"
        total = f" of {fmt_mib_gib(host.gpu_total)}" if host.gpu_total else ""
        text += f" · {fmt_mib_gib(host.gpu_free)} free{total}: {verdict}"
    if memory.budget is not None and memory.budget_source == "memory.gpu_memory":
        text += f" · budget {fmt_mib_gib(memory.budget)} (memory.gpu_memory)"
    return text + " · " + allocator_text(os.environ)


def host_memory_text(memory, host) -> str:
    """The plan's host RAM (memory/plan_figures.HOST_RAM) per rank and per node against the node's
    RAM; on CPU ranks it holds the rank's tensors too, and the RAM available now is said."""
    plan = memory.plan
    text = f"plan {fmt_mib_gib(plan.host_total)} per rank"
    if plan.cpu_ranks:
        tensors = fmt_mib_gib(plan.host.get("tensors", 0))
        text += f" (the process and its tensors: {tensors} at the peak)"
    if plan.ranks_per_node > 1:
        text += f", {fmt_mib_gib(plan.host_per_node)} per node ({_ranks(plan.ranks_per_node)})"
    if memory.host_budget is None:
        text += " · node RAM unknown (set resources.host_mem to check it)"
    else:
        verdict = "fits" if plan.host_fits else "DOES NOT FIT"
        budget = fmt_mib_gib(memory.host_budget)
        text += f" · node RAM {budget} ({memory.host_budget_source}): {verdict}"
    if plan.cpu_ranks and host.ram_available is not None:
        text += f" · {fmt_mib_gib(host.ram_available)} available now"
    return text


def gpu_sized_warning(spec: JobSpec, job, memory, host, step_time_s: float | None) -> list[str]:
    """On a host without GPUs, why this job is sized for GPUs ([] when CPU ranks suit it).

    `step_time_s`: the planner's estimate of one optimizer step on this host's CPU cores. The rule:
    that estimate above CPU_STEP_LIMIT_S, or the plan's memory for this node's ranks above the
    RAM available."""
    if host.has_gpu:
        return []
    reasons = []
    if step_time_s is not None and step_time_s > CPU_STEP_LIMIT_S:
        reasons.append(f"the planner estimates {fmt_duration(step_time_s)} per step on these "
                       f"{host.cpus} CPU core{'s' if host.cpus != 1 else ''} "
                       f"({fmt_duration(step_time_s * (job.total_steps or 0))} for "
                       f"{job.total_steps} steps)")
    plan = memory.plan
    if plan is not None and host.ram_available is not None:
        # the node's ranks: CPU ranks hold their tensors in host RAM (a GPU plan: beside it)
        beside = 0 if plan.cpu_ranks else plan.peak_allocated * job.gpus_per_node
        node = plan.host_per_node + beside
        if node > host.ram_available:
            reasons.append(f"its plan needs {fmt_mib_gib(node)} for {_ranks(job.gpus_per_node)}, "
                           f"more than the {fmt_mib_gib(host.ram_available)} of RAM available")
    if not reasons:
        return []
    if step_time_s is not None and not reasons[0].startswith("the planner"):
        reasons.append(f"est. {fmt_duration(step_time_s)} per step")
    return [f"WARNING: {spec['name']} is sized for GPUs and this host has none: "
            + "; ".join(reasons) + ".",
            "  It runs on CPU ranks anyway (Ctrl-C stops it). Run it on a GPU host, or make it "
            "smaller: model.config, training.micro_batch_size, data.synthetic.seq_len / "
            "data.max_length."]


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


# --- the closing summary -------------------------------------------------------------------------

def outcome_text(summary: RunSummary, exit_code: int, user_signal: str | None,
                 reason: str | None) -> str:
    """The exit status in words."""
    steps, total = summary.steps, summary.total_steps
    at = f" at step {steps} of {total}" if steps is not None and total else ""
    # a signal, --stop-after-steps: the ranks saved a checkpoint first
    if summary.status == "preempted":
        by = f" by {user_signal}" if user_signal else ""
        return (f"stopped{by}{at} with a checkpoint (exit {exit_code}); the command below "
                "continues from it")
    if user_signal:   # ended before the ranks saved one (a second Ctrl-C, the grace ran out)
        return f"stopped by {user_signal}{at} before a checkpoint was saved (exit {exit_code})"
    if exit_code == 0:
        done = f": {steps}/{total} steps" if steps is not None and total else ""
        elapsed = summary.elapsed_s
        return f"finished{done}" + (f" in {fmt_duration(elapsed)}" if elapsed else "") + " (exit 0)"
    first = (reason or summary.error or "").strip().splitlines()
    return f"FAILED{at} (exit {exit_code})" + (f": {first[0][:300]}" if first else "")


def closing_lines(summary: RunSummary | None, launch: dict, *, job_name: str, run_dir,
                  checkpoint_dir: str,
                  exit_code: int, user_signal: str | None = None, reason: str | None = None,
                  tracking: dict | None = None, experiment: str | None = None, style: bool = False,
                  model_tags: dict | None = None,
                  model_spec: JobSpecModel | None = None) -> list[str]:
    """The block printed when the job ends, also kept in summary.json (`report`) and as the MLflow
    run's description. `summary`: summary.json (None when no rank wrote one); `launch`: launch.json;
    `model_spec`: the resolved spec's `model` section (its LoRA and quantisation settings)."""
    summary = summary or RunSummary()
    lines = [_title(f"{job_name} {outcome_text(summary, exit_code, user_signal, reason)}", style)]
    losses = [f"{name} {value:.4f}"
              for name, value in (("train", summary.final_loss), ("eval", summary.eval_loss))
              if isinstance(value, (int, float))]
    if losses:
        lines.append(label("loss", style) + " · ".join(losses))
    metrics = eval_metrics_text(summary.eval_metrics)
    if metrics:
        lines.append(label("eval", style) + metrics)
    speed = throughput_text(summary)
    if speed:
        lines.append(label("throughput", style) + speed)
    lines += memory_lines(summary.peak_memory, launch.get("plan") or {}, style)
    counts = summary.parameters
    if counts.get("total") and counts.get("trainable") is not None \
            and counts["trainable"] < counts["total"]:
        # a frozen base (model.lora, model.freeze): what was trained of what was loaded
        lines.append(label("parameters", style)
                     + f"{counts['trainable']:,} trainable of {counts['total']:,} "
                     f"({100 * counts['trainable'] / counts['total']:.2f}%)")
    adapter = adapter_text(model_spec)
    if adapter:
        # what those trainable parameters are, so a run's report says which LoRA produced its loss
        lines.append(label("adapter", style) + adapter)
    answer = summary.generation   # training.eval_generate: the last evaluation's first answer
    if isinstance(answer, dict) and answer.get("generation") is not None:
        lines.append(label("answer", style)
                     + f"step {answer.get('step')}: {_excerpt(answer.get('prompt'))} -> "
                     f"{_excerpt(answer.get('generation'))}")
    if summary.checkpoint:
        lines.append(label("checkpoint", style) + os.path.join(checkpoint_dir, summary.checkpoint))
    for name, record in sorted(summary.exports.items()):
        path = record.get("path") if isinstance(record, dict) else record
        step = f" (step {record['step']})" if isinstance(record, dict) \
            and record.get("step") is not None else ""
        # where MLflow has it (export/artifacts tags): its artifacts, or why it was not uploaded
        stored = (model_tags or {}).get(f"jobspec.export.{name}.artifact")
        if stored is None:
            where = ""
        elif stored.startswith("not uploaded"):
            where = " · not uploaded to MLflow" + stored[len("not uploaded"):]
        elif stored.startswith("upload failed"):
            where = " · MLflow " + stored
        else:
            where = f" · MLflow artifacts {stored}"
        lines.append(label("model", style) + f"{name}: {path}{step}{where}")
    lines += tracking_lines(tracking, experiment, style=style)
    lines.append(label("run dir", style) + str(run_dir))
    return lines


def _excerpt(text, limit: int = 80) -> str:
    """One quoted line of at most `limit` characters."""
    flat = " ".join(str(text or "").split())
    return json.dumps(flat if len(flat) <= limit else flat[:limit - 1] + "…", ensure_ascii=False)


def adapter_text(model_spec: JobSpecModel | None) -> str:
    """`model.lora` and `model.quantization` in one line: `LoRA r 8 · alpha 16 · targets q_proj,
    v_proj · base 4-bit nf4 (double quant, compute auto)`; "" without LoRA."""
    lora = model_spec["lora"] if model_spec is not None else None
    if not lora:
        return ""
    targets = lora["target_modules"]
    parts = [f"LoRA r {lora['r']}", f"alpha {lora['alpha']:g}",
             "targets " + (targets if isinstance(targets, str) else ", ".join(targets))]
    variants = [name for name, on in (("rsLoRA", lora["use_rslora"]), ("DoRA", lora["use_dora"]))
                if on]
    if variants:
        parts.append(" + ".join(variants))
    quant = model_spec["quantization"] if model_spec is not None else None
    if quant:
        if quant["bits"] == 4:
            # `auto` compute is the training precision, which the header showed: only a chosen one
            # here
            notes = [note for note in ("double quant" if quant["double_quant"] else None,
                                       None if quant["compute_dtype"] == "auto"
                                       else f"compute {quant['compute_dtype']}") if note]
            parts.append(f"base 4-bit {quant['quant_type']}"
                         + (f" ({', '.join(notes)})" if notes else ""))
        else:
            parts.append("base 8-bit (LLM.int8)")
    return " · ".join(parts)


def eval_metrics_text(metrics: dict) -> str:
    """The last evaluation's task metrics (summary.json `eval_metrics`): `accuracy 87.5% · F1
    0.8667`."""
    parts = []
    for name in eval_metrics.TASK_ONLY:
        value = metrics.get(eval_metrics.key(name))
        if not isinstance(value, (int, float)):
            continue
        shown = f"{100 * value:.1f}%" if name == "accuracy" \
            else f"{value:.4g}" if name == "perplexity" else f"{value:.4f}"
        parts.append(f"{eval_metrics.label(name)} {shown}")
    return " · ".join(parts)


def throughput_text(summary: RunSummary) -> str:
    parts = []
    if summary.samples_per_s:
        parts.append(f"{summary.samples_per_s:.1f} samples/s")
    if summary.tokens_per_s:
        parts.append(f"{summary.tokens_per_s:,.0f} tokens/s")
    if summary.tflops_per_device:   # GPU ranks only: the peak FLOP/s of a CPU is unknown
        parts.append(f"{summary.tflops_per_device:.1f} TFLOP/s per GPU")
    if summary.mfu:
        parts.append(f"MFU {100 * summary.mfu:.1f}%")
    return " · ".join(parts)


def memory_lines(peaks: dict, plan: dict, style: bool) -> list[str]:
    """Each measured peak (max over ranks and windows, MiB) beside its plan (launch.json `plan`,
    MiB), by memory/plan_figures: the GPU's on a `memory` line, host RAM (RSS) on its own, as in the
    header."""
    planned = plan_figures.planned(plan)

    def versus(figure, what: str) -> str | None:
        if figure.metric not in peaks:
            return None
        shown = f" (plan {fmt_mib(planned[figure.metric])})" if figure.metric in planned else ""
        return f"{what} {fmt_mib(peaks[figure.metric])}{shown}"

    lines = []
    gpu = [text for text in (versus(f, f.label) for f in plan_figures.GPU_FIGURES) if text]
    if gpu:
        lines.append(label("memory", style) + " · ".join(gpu) + " per GPU")
    host = versus(HOST_RAM, "peak RSS")
    if host:
        lines.append(label(HOST_RAM.label, style) + host + " per rank")
    return lines
