"""`adamw`: built by DeepSpeed from the ds_config `optimizer` block; `implementation` picks the
Adam.

8 bytes of fp32 state per trainable parameter (two moments). The one optimizer DeepSpeed's optimizer
offload steps with its own CPU Adam.
"""
from __future__ import annotations

from jobspec.optimizers.base import DEEPSPEED_CPU_ADAM, Optimizer
from jobspec.spec.types import JobSpecTrainingOptimizer

NAME = "adamw"
WHERE = ("training", "optimizer")
CODE = "adam-settings"   # the rule code of every rule below (`validate --format json`)


def deepspeed_block(optimizer: JobSpecTrainingOptimizer, offload_optimizer: str = "none") -> dict:
    implementation: str = optimizer["implementation"]
    offloaded = offload_optimizer != "none"
    # DeepSpeed has no switch between its two Adams: optimizer offload means CPU Adam, else
    # FusedAdam (deepspeed/runtime/engine.py get_optimizer_configuration). An `implementation` the
    # offload cannot run is refused by `issues` below, on the written spec and again on one
    # `memory.fit` changed (validation.recheck, before any compile): stated once, here never
    # reached.
    params = {"lr": optimizer["lr"], "betas": list(optimizer["betas"]), "eps": optimizer["eps"],
              "weight_decay": optimizer["weight_decay"]}
    if implementation == "auto":
        implementation = auto_adam(optimizer, offloaded)
    if implementation == "torch":
        # torch.optim.AdamW takes no bias_correction (it always corrects): DeepSpeed passes the
        # remaining params to it as keywords. Its fused kernel (CUDA and CPU) needs no compiler,
        # keeps no param-sized temporaries (foreach does), and measured as fast as DeepSpeed's
        # JIT-built FusedAdam on CPU ranks (docs/benchmarks.md, bench/optimizer_kernels.py).
        params["torch_adam"] = True
        params["fused"] = True
    else:
        params["torch_adam"] = False   # DeepSpeed's FusedAdam / DeepSpeedCPUAdam, not torch.optim
        params["bias_correction"] = optimizer["bias_correction"]
    params["adam_w_mode"] = True   # decoupled weight decay
    return {"type": "AdamW", "params": params}


def auto_adam(optimizer: JobSpecTrainingOptimizer, offloaded: bool) -> str:
    """`implementation: auto`: the Adam that needs no op build wherever it can honour the spec.

    torch's AdamW, except with optimizer offload (DeepSpeed's CPU Adam is the one that steps there
    at speed: its op is built, announced, because the feature needs it) and with `bias_correction:
    false`, which only DeepSpeed's own Adams implement."""
    if offloaded:
        return "cpu"
    if not optimizer["bias_correction"]:
        return "fused"
    return "torch"


def state_bytes(optimizer: JobSpecTrainingOptimizer, inventory) -> int:
    return 8 * inventory.trainable


def offload_step(optimizer: JobSpecTrainingOptimizer) -> str | None:
    """With optimizer offload DeepSpeed's CPU Adam steps, unless `implementation: torch` asks for
    torch's."""
    return "torch.optim.AdamW" if optimizer["implementation"] == "torch" else None


def issues(r) -> list:
    """`implementation` against the optimizer offload and `bias_correction`."""
    s = r.spec
    optimizer, offload = s["training"]["optimizer"], s["memory"]["offload"]["optimizer"]
    implementation = optimizer["implementation"]
    found = []
    if implementation == "fused" and offload != "none":
        found.append(r.issue(WHERE + ("implementation",),
                             f"`fused` Adam cannot run with optimizer offload "
                             f"(memory.offload.optimizer is {offload}): DeepSpeed runs its CPU "
                             "Adam there",
                             "use `implementation: auto` (or `cpu`), or `memory.offload.optimizer: "
                             "none`", code=CODE))
    if implementation == "cpu" and offload == "none":
        found.append(r.issue(WHERE + ("implementation",),
                             "`cpu` Adam needs optimizer offload: DeepSpeed builds "
                             "its CPU Adam only for offloaded optimizer states",
                             "set `memory.offload.optimizer: cpu` (with zero_stage >= 1), or use "
                             "`auto`", code=CODE))
    if implementation == "torch" and not optimizer["bias_correction"]:
        found.append(r.issue(WHERE + ("bias_correction",),
                             "torch.optim.AdamW always corrects the bias: "
                             "`bias_correction: false` needs DeepSpeed's own Adam",
                             "use `implementation: auto`, `fused` or `cpu`, or remove "
                             "`bias_correction`", code=CODE))
    return found


def foreign_issues(r) -> list:
    """`implementation` and `bias_correction` set while another optimizer is chosen."""
    optimizer = r.spec["training"]["optimizer"]
    name = optimizer["name"]
    found = []
    if optimizer["implementation"] != "auto":
        found.append(r.issue(WHERE + ("implementation",),
                             f"`implementation` chooses the Adam of `adamw`, "
                             f"not of `{name}`", "remove it, or set `name: adamw`", code=CODE))
    if not optimizer["bias_correction"]:
        found.append(r.issue(WHERE + ("bias_correction",),
                             f"`bias_correction` is an Adam setting of `adamw`, "
                             f"not of `{name}`", "remove it, or set `name: adamw`", code=CODE))
    return found


OPTIMIZER = Optimizer(
    name=NAME,
    # torch's fused AdamW: what `implementation: auto` steps with when nothing is offloaded
    hf_trainer_optim="adamw_torch_fused",
    state_bytes=state_bytes,
    offload=DEEPSPEED_CPU_ADAM,
    args=("lr", "betas", "eps", "weight_decay", "implementation", "bias_correction"),
    deepspeed_block=deepspeed_block,
    issues=issues,
    foreign_issues=foreign_issues,
    zero_tested=True,
    offload_step=offload_step,
    fit_alternatives=("adamw_8bit",),
)
