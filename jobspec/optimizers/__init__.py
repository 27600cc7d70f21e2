"""The optimizers a spec can name (`training.optimizer.name`): one module each, registered here.

Each module (adamw, adamw_8bit, adafactor, sgd) declares an `Optimizer`
(jobspec/optimizers/base.py): how it is built (DeepSpeed's config block, or a client optimizer the
ranks build from exactly the args its `client_args` writes from the resolved spec, which `jobspec
compile` prints), its state bytes per parameter for the planner, whether DeepSpeed's optimizer
offload can hold it, the spec fields it reads and its cross-field rules. The compiler, the planner,
the fit search, validation and the ranks read it from `OPTIMIZERS`; a test keeps the keys equal to
the schema's enum (tests/test_registries.py). Adding one: the schema's enum, one module here, one
line below (docs/architecture.md, "Adding an optimizer").

Pure: no torch at import (the client optimizers' `build` imports it on the ranks).
"""
from __future__ import annotations

from jobspec.optimizers import adafactor, adamw, adamw_8bit, sgd
from jobspec.optimizers.base import Optimizer

OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    adamw.OPTIMIZER,
    adamw_8bit.OPTIMIZER,
    adafactor.OPTIMIZER,
    sgd.OPTIMIZER,
)}


def get(name: str) -> Optimizer:
    return OPTIMIZERS[name]


def deepspeed_built() -> tuple[str, ...]:
    """The optimizers DeepSpeed builds from the ds_config `optimizer` block."""
    return tuple(name for name, o in OPTIMIZERS.items() if o.built_by_deepspeed)


def client_built() -> tuple[str, ...]:
    """The optimizers the ranks build (train/patches.client_optimizer) and DeepSpeed wraps."""
    return tuple(name for name, o in OPTIMIZERS.items() if not o.built_by_deepspeed)


def rule_issues(r) -> list:
    """The optimizer rules of a defaults-filled spec (r: a ResolvedSpec): offload, the chosen
    optimizer's own rules, and the fields of the others that were set."""
    s = r.spec
    name = s["training"]["optimizer"]["name"]
    chosen = OPTIMIZERS[name]
    found = []
    if chosen.offload is None and s["memory"]["offload"]["optimizer"] != "none":
        found.append(r.issue(("training", "optimizer", "name"),
                             f"`{name}` cannot be used with optimizer offload",
                             "DeepSpeed's optimizer offload needs its own CPU Adam: use `adamw`, "
                             "or set `memory.offload.optimizer: none`",
                             code="client-optimizer-offload"))
    for other in OPTIMIZERS.values():
        found += chosen.issues(r) if other is chosen else other.foreign_issues(r)
    return found
