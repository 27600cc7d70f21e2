"""How fast a GPU trains, as measured: the achieved FLOP/s the step-time model
(memory/fit.step_time) uses for a GPU with readings, and the formula it falls back to for any other.

A GPU's readings (`GPU_READINGS`, from the `throughput` and `matmul` sections of
bench/calibration/*.json, which tests/memory/test_gpu_throughput.py holds equal to this table) are
one-rank ZeRO-0 training runs (tokens/s, and the job's hardware FLOPs per token as the planner
traces it: recompute included) and a large bf16 matmul, the most the GPU's tensor cores reach. A
run's achieved FLOP/s over that ceiling is its efficiency `e`, and small micro-batches and narrow
layers under-use the GPU: the model is

    e(tokens, hidden) = tokens / (tokens + K * (REFERENCE_HIDDEN / hidden) ** HIDDEN_EXPONENT)

with `tokens` per micro-batch: K is the micro-batch at which a layer of REFERENCE_HIDDEN width runs
at half the matmul rate. Each reading gives its own K (solved from its `e`); the GPU's K is their
geometric mean. On the H200 the three readings (TinyLlama shape, hidden 2048, 8K tokens; XLM-R
large, hidden 1024, 16K tokens; Llama-3.2-1B shape, hidden 2048, 64K tokens) give K = 13.4K, 13.1K
and 14.2K with the exponent 2; the one reading at another width (1024) is what sets the exponent.
Another precision scales the ceiling by the datasheet's ratio to bf16 (fp16: the same tensor-core
rate; fp32 with `memory.tf32`: TF32's; fp32: FP32's).

A GPU without readings (or `jobspec plan` without `--gpu`) gets the reference formula
(memory/fit.EFFECTIVE_FLOPS, HALF_SATURATION_TOKENS: an A100-class device), which ranks
configurations but does not claim a tokens/s figure for a real GPU.

Pure: names and numbers in, numbers out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

REFERENCE_HIDDEN = 2048
HIDDEN_EXPONENT = 2.0


@dataclass(frozen=True)
class ThroughputReading:
    """One measured training run of one rank (the calibration file's `throughput` entry `job`)."""

    job: str
    hidden_size: int
    tokens_per_micro_batch: int
    hardware_flops_per_token: float   # the planner's, for the job's spec (recompute included)
    tokens_per_s: float
    mfu: float                        # model FLOPs over the datasheet's bf16 peak, as reported


@dataclass(frozen=True)
class GpuReadings:
    """A GPU's measured speed: its matmul ceiling, datasheet peaks and training runs."""

    gpu: str                  # a substring of the device name NVML reports, e.g. "H200"
    matmul_flops: float       # bf16, the 8192^3 matmul of the calibration file
    peak_flops: dict[str, float]   # the datasheet's dense peak: bf16, fp16, tf32, fp32
    readings: tuple[ThroughputReading, ...]
    source: str               # the calibration file that holds them
    # `model.compile` measured on it (bench/gpu_throughput.py): (seconds compiling in the first
    # step, uncompiled / compiled step time); None: not measured
    compile: tuple[float, float] | None = None

    def half_saturation(self) -> float:
        """K at REFERENCE_HIDDEN: the geometric mean of the readings' own (see the module
        docstring)."""
        ks = [_reading_k(self, r) for r in self.readings]
        return math.exp(sum(math.log(k) for k in ks) / len(ks))

    def achieved_flops(self, precision: str, tokens: int, hidden: int) -> float:
        """Hardware FLOP/s a micro-batch of `tokens` reaches on layers `hidden` wide, in `precision`
        ("bf16", "fp16", "tf32" or "fp32")."""
        ceiling = self.matmul_flops * self.peak_flops[precision] / self.peak_flops["bf16"]
        k = self.half_saturation() * math.pow(REFERENCE_HIDDEN / hidden, HIDDEN_EXPONENT)
        return ceiling * tokens / (tokens + k)


def _reading_k(gpu: GpuReadings, reading: ThroughputReading) -> float:
    efficiency = reading.hardware_flops_per_token * reading.tokens_per_s / gpu.matmul_flops
    k = reading.tokens_per_micro_batch * (1 / efficiency - 1)
    return k * math.pow(reading.hidden_size / REFERENCE_HIDDEN, HIDDEN_EXPONENT)


H200_SOURCE = "bench/calibration/h200-2026-11-28.json"
GPU_READINGS = (
    GpuReadings(
        "H200", 790e12, {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 66.9e12},
        (ThroughputReading("tinyllama-bf16-sdpa-b4-s2048", 2048, 8192, 7.498367e9, 39912, 0.302),
         ThroughputReading("xlmr-large-bf16-sdpa-b32-s512", 1024, 16384, 1.988112e9, 94736, 0.190),
         ThroughputReading("llama-1b-64k-ckpt-tiled-loss", 2048, 65536, 4.800381e10, 13533, 0.513)),
        H200_SOURCE),
)


def readings_for(gpu_name: str | None) -> GpuReadings | None:
    """The readings of the GPU named `gpu_name` (NVML's name, or any text holding the table's name:
    "H200"); None when there are none, or no name."""
    if not gpu_name:
        return None
    for gpu in GPU_READINGS:
        if gpu.gpu.lower() in gpu_name.lower():
            return gpu
    return None


def precision_key(precision: str, tf32: bool) -> str:
    """The datasheet row a job's `memory.precision` runs at: fp32 with `memory.tf32` on is TF32's.
    """
    return "tf32" if precision == "fp32" and tf32 else precision
