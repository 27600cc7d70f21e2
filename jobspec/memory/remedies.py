"""What moves a plan's largest GPU term when the job does not fit: settings that can be followed.

Each term has its remedies, in the order they cost step time; a remedy is offered only when its
setting is not on already and validation accepts it for this job (a tiled loss for causal LMs only,
and not for a head tied to the embeddings under ZeRO 1-3; no ZeRO-3 or parameter offload for a
quantised base, whose packed weights ZeRO 0-2 keep whole; with `model.compile` no ZeRO-3, quantised
base, tiled MLP or offloaded checkpoint inputs (techniques/regional_compile.py); checkpointing every
layer only when some layer is not, so a written `offload: cpu` is never dropped). A causal LM is
always told that a shorter sequence fits, and where to find the longest (`jobspec plan --longest`).
`jobspec plan --fit` searches all of them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobspec import optimizers, techniques
from jobspec.memory.fit import to_overrides
from jobspec.memory.planner import ROWS, MemoryPlan
from jobspec.optimizers.base import DEEPSPEED_CPU_ADAM
from jobspec.spec.types import JobSpec
from jobspec.units import fmt_mib_gib

Check = Callable[[JobSpec, MemoryPlan], bool]


@dataclass(frozen=True)
class Remedy:
    # what to do: `--set`s, or words where it is not one setting (a function: it depends on the job)
    text: str | Callable[[JobSpec, MemoryPlan], str]
    applies: Check         # whether it is not on already and validation accepts it here

    def says(self, spec: JobSpec, plan: MemoryPlan) -> str:
        return self.text if isinstance(self.text, str) else self.text(spec, plan)


def _causal(spec: JobSpec, plan: MemoryPlan) -> bool:
    return spec["model"]["task"] == "causal-lm"


def _technique_remedy(name: str, term: str) -> Remedy:
    """A technique's remedy of a plan's term, offered where its module says (jobspec/techniques)."""
    technique = techniques.get(name)
    return Remedy(technique.remedy[term],
                  lambda spec, plan: technique.offerable(spec, int(plan.settings["zero_stage"])))


def _some_layers_kept(spec: JobSpec, plan: MemoryPlan) -> bool:
    return int(plan.settings["checkpointed_layers"]) < int(plan.settings["layers"])


def _inputs_on_gpu(spec: JobSpec, plan: MemoryPlan) -> bool:
    checkpointing = spec["memory"]["activation_checkpointing"]
    offloaded = isinstance(checkpointing, dict) and checkpointing["offload"] == "cpu"
    return not _some_layers_kept(spec, plan) and plan.settings["layers"] > 0 and not offloaded \
        and not spec["model"]["compile"]


def _zero3_allowed(spec: JobSpec, plan: MemoryPlan) -> bool:
    return _highest_zero(spec) == 3 and int(plan.settings["zero_stage"]) < 3


def _highest_zero(spec: JobSpec) -> int:
    """The highest ZeRO stage validation accepts: 2 for a quantised base and under model.compile."""
    return 2 if spec["model"]["quantization"] is not None or spec["model"]["compile"] else 3


def _zero_up_to(highest: int) -> Check:
    def check(spec: JobSpec, plan: MemoryPlan) -> bool:
        return int(plan.settings["zero_stage"]) < min(highest, _highest_zero(spec))
    return check


def _optimizer_on_gpu(spec: JobSpec, plan: MemoryPlan) -> bool:
    """On the GPU, and one DeepSpeed's CPU Adam can take over (not a pinned fused
    implementation)."""
    optimizer = spec["training"]["optimizer"]
    return plan.settings["offload_optimizer"] == "none" and optimizer["implementation"] != "fused" \
        and optimizers.get(optimizer["name"]).offload == DEEPSPEED_CPU_ADAM


def _not_quantized(spec: JobSpec, plan: MemoryPlan) -> bool:
    return spec["model"]["quantization"] is None


def _quantizable(spec: JobSpec, plan: MemoryPlan) -> bool:
    return _not_quantized(spec, plan) and not spec["model"]["compile"]


def _no_sequence_parallel(spec: JobSpec, plan: MemoryPlan) -> bool:
    return int(plan.settings["sequence_parallel"]) == 1


def _always(spec: JobSpec, plan: MemoryPlan) -> bool:
    return True


_OFFLOAD_INPUTS = " ".join(f"--set {o}" for o in to_overrides(
    {"memory.activation_checkpointing": {"every_n_layers": 1, "offload": "cpu"}}))
_CHECKPOINT = Remedy("--set memory.activation_checkpointing=true (every layer keeps only its "
                     "input)",
                     _some_layers_kept)
_SHORTER = Remedy("a shorter sequence (`jobspec plan --longest` finds the longest that fits)",
                  _causal)
_SEQUENCE_PARALLEL = Remedy("memory.sequence_parallel with more GPUs (ranks share the sequence)",
                            _no_sequence_parallel)
def _zero_text(spec: JobSpec, plan: MemoryPlan) -> str:
    highest = _highest_zero(spec)
    stages = " or ".join(str(n) for n in range(plan.settings["zero_stage"] + 1, highest + 1))
    return f"memory.zero_stage: {stages} over more GPUs (the states partitioned)"


_ZERO = Remedy(_zero_text, _zero_up_to(3))
def _offload_optimizer_text(spec: JobSpec, plan: MemoryPlan) -> str:
    # offload needs ZeRO
    stage = "--set memory.zero_stage=1 " if plan.settings["zero_stage"] == 0 else ""
    return f"{stage}--set memory.offload.optimizer=cpu (the optimizer's states in host memory)"


_OFFLOAD_OPTIMIZER = Remedy(_offload_optimizer_text, _optimizer_on_gpu)

REMEDIES: dict[str, tuple[Remedy, ...]] = {
    "logits_and_loss": (_technique_remedy("tiled_loss", "logits_and_loss"), _SHORTER),
    "activations": (_CHECKPOINT,
                    Remedy(f"{_OFFLOAD_INPUTS} (checkpointed inputs in host memory)",
                           _inputs_on_gpu),
                    _technique_remedy("tiled_mlp", "activations"),
                    _SEQUENCE_PARALLEL, _SHORTER),
    "embeddings_activations": (_SEQUENCE_PARALLEL, _SHORTER),
    "optimizer_states": (_ZERO, _OFFLOAD_OPTIMIZER),
    "master_weights": (_ZERO, _OFFLOAD_OPTIMIZER),
    "step_gradients": (_ZERO, _OFFLOAD_OPTIMIZER),
    "gradients": (Remedy("memory.zero_stage: 2 over more GPUs (gradients partitioned)",
                         _zero_up_to(2)),),
    "parameters": (Remedy("memory.zero_stage: 3 over more GPUs", _zero3_allowed),
                   Remedy("model.quantization with model.lora (QLoRA: a 4-bit base)",
                          _quantizable)),
    "gathered_parameters": (Remedy("a smaller memory.zero.stage3_prefetch_bucket_size", _always),),
    "zero_buffers": (Remedy("a smaller memory.zero.reduce_bucket_size", _always),),
}


def remedies(term: str, spec: JobSpec, plan: MemoryPlan) -> list[str]:
    """The remedies of one GPU term that apply to this job (see the module docstring)."""
    return [remedy.says(spec, plan) for remedy in REMEDIES.get(term, ())
            if remedy.applies(spec, plan)]


def advice(plan: MemoryPlan, spec: JobSpec) -> str | None:
    """For a plan over its GPU budget: the largest term and what moves it; None when it fits."""
    if plan.gpu_fits is not False:
        return None
    term = max(REMEDIES, key=lambda key: plan.breakdown.get(key, 0))
    label = dict(ROWS)[term]
    moves = remedies(term, spec, plan)
    what = "; ".join(moves) if moves \
        else "nothing this job has not already (more GPUs, or a smaller model)"
    return (f"over by {fmt_mib_gib(-(plan.headroom or 0))}; the largest term is {label} "
            f"({fmt_mib_gib(plan.breakdown[term])}): {what}; `jobspec plan --fit` searches them "
            "all")
