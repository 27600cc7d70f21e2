"""How a rank constructs its model: in the training dtype, on its device, and partitioned under
ZeRO-3.

A model built whole in fp32 on the host and partitioned only in `deepspeed.initialize` would take
280 GB of host memory per rank for a 70B model before the first step.

- **ZeRO-3**: the model is created inside DeepSpeed's `zero.Init`, which partitions each module's
  parameters as soon as the module is built, so a rank holds its partition (Ψ/world elements in the
  training dtype) plus the module being built or initialised at the moment. Transformers models go
  through transformers' own integration: a live `HfDeepSpeedConfig` makes
  `is_deepspeed_zero3_enabled()` true, `from_config` wraps the constructor in `zero.Init` and
  initialises weights one gathered module at a time (rank 0 draws them), and `from_pretrained`
  copies the checkpoint into the partitions layer by layer (`GatheredParameters`, modifier rank 0).
  The other ranks read only the tensors' shapes (meta); rank 0 reads the values, and transformers 5
  merges every shard's tensors into one dict before copying, so rank 0 alone briefly holds the
  checkpoint in its stored dtype: on a node with rank 0 that is one checkpoint more, not one per
  rank. jobspec's own MLP is built under `zero.Init` directly.
- **ZeRO 0/1/2** keep a full copy per rank by design (DeepSpeed partitions optimizer states and
  gradients only), built straight in the training dtype (bf16/fp16 jobs never hold an fp32 copy) and
  on the rank's device (`rank_device`): on a GPU rank `from_config` runs under that device, so the
  weights are created and drawn by the model's `_init_weights` on the GPU, never on the host, and a
  checkpoint loads onto it (`device_map`); on a CPU rank the build is transformers' own, unchanged.
  QLoRA's base is made module by module and quantised as it is made (model/build `_quantized`).

The training dtype is read from the compiled DeepSpeed config (its `bf16`/`fp16` blocks): the same
dtype DeepSpeed's engine would cast the module to, so nothing changes in what trains, only when
the cast happens and how much memory the construction peaks at.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

# transformers keeps its HfDeepSpeedConfig as a weak reference only ("it's important that this
# object remains alive"): this module owns it while the process trains under ZeRO-3. PEFT and
# transformers query it after construction too (gathering parameters to wrap or resize them).
_LIVE_HF_CONFIG: list[Any] = []


@dataclass(frozen=True)
class Construction:
    """What `build_model` needs to know about the engine the model is built for."""

    precision: str                 # "bf16" | "fp16" | "fp32": the dtype the engine trains in
    zero3: bool                    # built under zero.Init, partitioned
    ds_config: dict | None = None  # the compiled DeepSpeed config zero.Init reads (ZeRO-3 only)

    @property
    def torch_dtype(self):
        import torch
        return {"bf16": torch.bfloat16, "fp16": torch.float16,
                "fp32": torch.float32}[self.precision]

    def describe(self) -> str:
        how = "partitioned under deepspeed.zero.Init" if self.zero3 else "a full copy per rank"
        return f"{how}, in {self.precision}"


FP32 = Construction(precision="fp32", zero3=False)   # no engine: what export, tests and tools build


def construction_for(ds_config: dict | None) -> Construction:
    """The construction a compiled DeepSpeed config asks for; FP32 without one."""
    if not ds_config:
        return FP32
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        precision = "bf16"
    elif (ds_config.get("fp16") or {}).get("enabled"):
        precision = "fp16"
    else:
        precision = "fp32"
    zero3 = int((ds_config.get("zero_optimization") or {}).get("stage", 0)) == 3
    return Construction(precision=precision, zero3=zero3, ds_config=ds_config if zero3 else None)


def rank_device():
    """The device this rank trains on and builds its model on: `cuda:<LOCAL_RANK>` where CUDA is
    available (where DeepSpeed's engine puts the module), else the CPU."""
    import os

    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def set_transformers_zero3(construction: Construction) -> None:
    """Tell transformers whether the models it builds from now on are partitioned (ZeRO-3) or not.

    Called before every build, so that a process that builds a ZeRO-3 model and later another one
    (tests, tools) never partitions the second one by accident."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    _LIVE_HF_CONFIG.clear()
    unset_hf_deepspeed_config()
    if construction.zero3:
        _LIVE_HF_CONFIG.append(HfDeepSpeedConfig(construction.ds_config))


@contextmanager
def without_transformers_zero3() -> Iterator[None]:
    """Models transformers builds inside are whole, even while this process trains under ZeRO-3: a
    meta-device skeleton that one rank builds alone (an export) must not enter zero.Init, whose
    construction is collective and would wait for the other ranks forever."""
    if "transformers.integrations.deepspeed" not in sys.modules:
        yield   # no ZeRO-3 config of transformers' can be live; jobspec's MLP needs no transformers
        return
    from transformers.integrations.deepspeed import (
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if _LIVE_HF_CONFIG:
            set_hf_deepspeed_config(_LIVE_HF_CONFIG[0])


@contextmanager
def default_dtype(dtype) -> Iterator[None]:
    """Parameters created inside are allocated in `dtype` (no fp32 tensor first, then a cast)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextmanager
def zero_init(construction: Construction) -> Iterator[None]:
    """`deepspeed.zero.Init` for a ZeRO-3 construction (models transformers does not build), else
    the training dtype as the default dtype."""
    if not construction.zero3:
        with default_dtype(construction.torch_dtype):
            yield
        return
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=construction.ds_config,
                             dtype=construction.torch_dtype):
        yield


@dataclass(frozen=True)
class Partitions:
    """The parameter elements this rank holds against the model's total, counted from the
    tensors."""

    held: int        # elements in this rank's partitions (ds_tensor) or, unpartitioned, all of them
    total: int       # elements of the full parameters (ds_numel)
    partitioned: bool

    @property
    def fraction(self) -> float:
        return self.held / self.total if self.total else 1.0


def count_partitions(model) -> Partitions:
    """How much of the model this rank holds: ZeRO-3 parameters (`ds_id`) count their partition
    `ds_tensor`, whose storage is what the rank really keeps (the parameter itself is an empty
    placeholder between gathers); other parameters count whole."""
    held = total = 0
    partitioned = False
    for param in model.parameters():
        if hasattr(param, "ds_id"):
            partitioned = True
            held += param.ds_tensor.numel()
            total += param.ds_numel
        else:
            held += param.numel()
            total += param.numel()
    return Partitions(held=held, total=total, partitioned=partitioned)


def construction_line(rank: int, construction: Construction, parts: Partitions,
                      peak_rss_mib: float) -> str:
    """The ranks' `jobspec-log:` record of a construction (read by tests and bench/zero_init.py)."""
    return (f"construction rank{rank} {'zero3' if construction.zero3 else 'full'} "
            f"{construction.precision} held={parts.held} total={parts.total} "
            f"fraction={parts.fraction:.4f} peak_rss_mib={peak_rss_mib:.1f}")
