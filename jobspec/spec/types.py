"""The resolved job spec's types, generated from schemas/jobspec.schema.json by
scripts/gen_spec_types.py: do not edit by hand (tests/spec/test_spec_types.py keeps it in step).

A spec after validation has every field (defaults filled), so every key is required.
"""
from __future__ import annotations

from typing import Any, Literal, TypedDict


class JobSpecModelLora(TypedDict):
    """LoRA settings (peft.LoraConfig)."""
    r: int
    alpha: float
    dropout: float
    target_modules: Literal["all-linear"] | list[str]
    modules_to_save: list[str] | None
    bias: Literal["none", "all", "lora_only"]
    use_rslora: bool
    use_dora: bool


class JobSpecModelQuantization(TypedDict):
    """Quantisation settings (transformers.BitsAndBytesConfig)."""
    bits: Literal[4, 8]
    quant_type: Literal["nf4", "fp4"]
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"]
    double_quant: bool


class JobSpecModel(TypedDict):
    """The model to train: a hub id or local directory (`name_or_path`), or an architecture built
    from a config with random weights (`architecture` + `config`).
    """
    name_or_path: str | None
    architecture: str | None
    config: dict[str, Any]
    revision: str | None
    task: Literal["sequence-classification", "token-classification", "masked-lm", "causal-lm"]
    num_labels: int
    attention: Literal["sdpa", "eager", "flash_attention_2"]
    kernels: Literal["none", "liger"]
    trust_remote_code: bool
    freeze: list[str]
    lora: JobSpecModelLora | None
    quantization: JobSpecModelQuantization | None
    compile: bool


class JobSpecDataSynthetic(TypedDict):
    """Synthetic data settings."""
    num_samples: int
    eval_samples: int
    seq_len: int
    vocab_range: list[int]
    labels: Literal["random", "learnable"]


class JobSpecData(TypedDict):
    """Training and evaluation data: local files (records or plain text), datasets by name, or
    synthetic random tokens.
    """
    train: str | None
    eval: str | None
    format: Literal["auto", "jsonl", "csv", "parquet", "text"]
    records: Literal["auto", "text", "chat", "prompt_completion"]
    document: Literal["line", "file"]
    chunking: Literal["concatenate", "per_document"]
    messages_field: str
    prompt_field: str
    completion_field: str
    chat_template: str | None
    loss_on: Literal["answers", "all"]
    text_fields: list[str]
    label_field: str
    max_length: int
    padding: Literal["max_length", "longest"]
    num_proc: int | None
    packing: bool
    tokenizer: str | None
    subset: str | None
    train_split: str
    eval_split: str
    shuffle: bool
    num_workers: int
    pin_memory: bool
    synthetic: JobSpecDataSynthetic | None


class JobSpecTrainingOptimizer(TypedDict):
    """Optimizer and its hyper-parameters."""
    name: Literal["adamw", "adamw_8bit", "adafactor", "sgd"]
    implementation: Literal["auto", "fused", "cpu", "torch"]
    lr: float
    betas: list[float]
    eps: float
    bias_correction: bool
    weight_decay: float
    weight_decay_on: Literal["matrices", "all"]
    momentum: float


class JobSpecTrainingScheduler(TypedDict):
    """Learning-rate schedule: warmup from 0 to `lr`, then constant, linear decay or cosine decay to
    `min_lr_ratio * lr`.
    """
    name: Literal["constant", "linear", "cosine"]
    warmup_steps: int
    warmup_ratio: float
    min_lr_ratio: float


class JobSpecTrainingEvalGenerate(TypedDict):
    """Generation at evaluation."""
    prompts: int | str
    max_new_tokens: int
    temperature: float
    seed: int | None


class JobSpecTraining(TypedDict):
    """Steps, batch sizes, optimizer and schedule."""
    max_steps: int | None
    epochs: float | None
    global_batch_size: int | None
    micro_batch_size: int
    optimizer: JobSpecTrainingOptimizer
    scheduler: JobSpecTrainingScheduler
    gradient_clipping: float
    on_oom: Literal["fail", "halve_micro_batch"]
    on_nan: Literal["stop", "skip"]
    seed: int
    eval_every: int | None
    eval_generate: JobSpecTrainingEvalGenerate | None


class JobSpecMemoryFp16(TypedDict):
    """Loss scaling and input casting for `precision: fp16`."""
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: int
    auto_cast: bool


class JobSpecMemoryTiledLoss(TypedDict):
    """Tiled loss with a fixed number of tiles."""
    tiles: int


class JobSpecMemoryOffloadAio(TypedDict):
    """Asynchronous I/O tuning for NVMe offload (DeepSpeed `aio` block)."""
    block_size: int
    queue_depth: int
    thread_count: int
    single_submit: bool
    overlap_events: bool


class JobSpecMemoryOffload(TypedDict):
    """Move optimizer states and/or parameters off the GPU."""
    optimizer: Literal["none", "cpu", "nvme"]
    params: Literal["none", "cpu", "nvme"]
    nvme_path: str | None
    pin_memory: bool
    buffer_count: int
    buffer_size: int
    aio: JobSpecMemoryOffloadAio


class JobSpecMemoryActivationCheckpointing(TypedDict):
    """Checkpoint every k-th transformer layer."""
    every_n_layers: int
    use_reentrant: bool
    offload: Literal["none", "cpu"]


class JobSpecMemoryZero(TypedDict):
    """Advanced ZeRO knobs."""
    overlap_comm: bool | None
    contiguous_gradients: bool
    reduce_scatter: bool
    reduce_bucket_size: int | None
    allgather_bucket_size: int | None
    stage3_prefetch_bucket_size: int | None
    stage3_param_persistence_threshold: int | None
    stage3_max_live_parameters: int
    stage3_max_reuse_distance: int
    sub_group_size: int
    round_robin_gradients: bool


class JobSpecMemory(TypedDict):
    """Precision and the memory techniques: ZeRO, offload, activation checkpointing."""
    precision: Literal["fp32", "fp16", "bf16"]
    fp16: JobSpecMemoryFp16
    fit: Literal["off", "auto"]
    gpu_memory: str | None
    tf32: bool
    zero_stage: int
    sequence_parallel: int
    tiled_loss: bool | JobSpecMemoryTiledLoss
    tiled_mlp: bool
    offload: JobSpecMemoryOffload
    activation_checkpointing: bool | JobSpecMemoryActivationCheckpointing
    zero: JobSpecMemoryZero


class JobSpecResourcesSlurm(TypedDict):
    """Slurm batch settings used by `jobspec sbatch` and `launch.sh`."""
    partition: str | None
    account: str | None
    qos: str | None
    time: str
    constraint: str | None
    cpus_per_task: int | None
    mem: str | None
    exclusive: bool
    output: str
    error: str | None
    requeue: bool
    signal_grace_seconds: int


class JobSpecResources(TypedDict):
    """Where the job runs."""
    nodes: int
    gpus_per_node: int
    host_mem: str | None
    master_port: int | None
    master_addr: str | None
    slurm: JobSpecResourcesSlurm


class JobSpecLoggingMlflow(TypedDict):
    """MLflow tracking."""
    enabled: bool
    tracking_uri: str
    experiment: str
    run_name: str | None
    tags: dict[str, Any]
    required: bool


class JobSpecLoggingTensorboard(TypedDict):
    """TensorBoard event files, written beside MLflow (or instead of it) for `tensorboard --logdir`:
    every metric row as scalars by step (rank 0's metrics.jsonl, the same points MLflow gets),
    the resolved spec and the DeepSpeed config as text, and the run's settings and final status
    in the HParams tab.
    """
    enabled: bool


class JobSpecLogging(TypedDict):
    """Experiment tracking and progress output."""
    mlflow: JobSpecLoggingMlflow
    tensorboard: JobSpecLoggingTensorboard
    every_n_steps: int
    perf_window_s: float
    system_metrics: bool
    progress: Literal["auto", "bar", "lines", "none"]


class JobSpecCheckpoint(TypedDict):
    """Checkpoints and resume."""
    dir: str
    every_n_steps: int | None
    keep_last: int
    save_final: bool
    resume: str


class JobSpecExport(TypedDict):
    """The trained model as a Hugging Face directory that `AutoModelFor<task>.from_pretrained`
    loads: config.json, safetensors weights, the tokenizer (when the job has one) and a README.md
    model card with the job spec and the metrics.
    """
    final: bool
    adapter: Literal["merged", "adapter", "both"]
    at_checkpoints: bool
    best_eval: bool
    best_metric: Literal["loss", "accuracy", "f1", "perplexity"]
    dir: str | None
    dtype: Literal["auto", "fp32", "bf16", "fp16"]
    max_shard_size: str
    mlflow_max_mb: float


class JobSpec(TypedDict):
    """A resolved job spec."""
    name: str
    description: str
    extends: str | None
    output_dir: str
    model: JobSpecModel
    data: JobSpecData
    training: JobSpecTraining
    memory: JobSpecMemory
    resources: JobSpecResources
    logging: JobSpecLogging
    checkpoint: JobSpecCheckpoint
    export: JobSpecExport
    deepspeed: dict[str, Any]
