"""The HF Trainer doing what a jobspec job does: the baseline `python -m bench` compares against.

    python -m bench.trainer_baseline --run-dir DIR --out result.json
    deepspeed --num_gpus N --module bench.trainer_baseline --run-dir DIR --out result.json   # ZeRO >= 1

DIR is a `jobspec compile --out` directory. The baseline builds the same model from the same config
and seed (`jobspec.model.build.build_model`), the same synthetic samples (`jobspec.data.loaders.synthetic_dataset`:
same seed, same token ids), and `TrainingArguments` with the job's micro/global batch, accumulation,
precision, gradient checkpointing, optimizer, schedule, clipping and max_steps; with ZeRO >= 1 it
passes the compiled `ds_config.json` as `deepspeed=`, so both sides run the same DeepSpeed config.

Throughput is steady state, measured like the worker's: windows of `logging.every_n_steps` optimizer
steps timed by a callback, the first window (warm-up) left out, the median of the rest. Rank 0
writes the result JSON (the shared metric names).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from jobspec import optimizers

# jobspec scheduler name -> TrainingArguments.lr_scheduler_type (warmup then ...)
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def checkpointing_arg_names() -> tuple[str, str]:
    """transformers 5 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs)."""
    import dataclasses

    from transformers import TrainingArguments
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "activation_checkpointing" in names:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def uses_deepspeed(spec: dict) -> bool:
    return spec["memory"]["zero_stage"] >= 1


def baseline_command(run_dir: Path, out: Path) -> list[str]:
    """The command running bench.trainer_baseline on a compiled run dir (through the runner for ZeRO
    or > 1 rank)."""
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    module = ["--module", "bench.trainer_baseline", "--run-dir", str(run_dir), "--out", str(out)]
    world = spec["resources"]["gpus_per_node"]
    if uses_deepspeed(spec) or world > 1:  # the runner sets up the ranks' distributed environment
        from jobspec.launch.runner import free_port, runner_prefix
        return runner_prefix() + ["--num_gpus", str(world), "--master_port", str(free_port()), *module]
    return [sys.executable, "-m", *module[1:]]


def training_arguments_kwargs(spec: dict, derived: dict, ds_config: dict, output_dir: str | Path,
                              *, use_cpu: bool = True) -> dict:
    """TrainingArguments keyword arguments equivalent to a compiled job (pure: tested without training)."""
    training, memory, data = spec["training"], spec["memory"], spec["data"]
    optimizer = training["optimizer"]
    checkpointing = memory["activation_checkpointing"]
    deepspeed = uses_deepspeed(spec)
    checkpointing_name, checkpointing_kwargs_name = checkpointing_arg_names()
    # With a DeepSpeed config the Trainer checks that its warmup equals the config's, and the
    # compiler writes DeepSpeed's minimum of 1 warmup step.
    warmup = ds_config["scheduler"]["params"]["warmup_num_steps"] if deepspeed else derived["warmup_steps"]
    kwargs = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": derived["micro_batch_size"],
        "gradient_accumulation_steps": derived["gradient_accumulation_steps"],
        "max_steps": derived["total_steps"],
        "learning_rate": optimizer["lr"],
        "weight_decay": optimizer["weight_decay"],
        "adam_beta1": optimizer["betas"][0],
        "adam_beta2": optimizer["betas"][1],
        "adam_epsilon": optimizer["eps"],
        "optim": optimizers.get(optimizer["name"]).hf_trainer_optim,   # TrainingArguments.optim
        "max_grad_norm": training["gradient_clipping"],
        "lr_scheduler_type": SCHEDULES[training["scheduler"]["name"]],
        "warmup_steps": warmup,
        "fp16": memory["precision"] == "fp16",
        "bf16": memory["precision"] == "bf16",
        checkpointing_name: bool(checkpointing),
        "seed": training["seed"],
        "data_seed": training["seed"],
        "dataloader_num_workers": data["num_workers"],
        "dataloader_pin_memory": data["pin_memory"] and not use_cpu,
        "dataloader_drop_last": True,           # like jobspec's loader: every step a full micro-batch
        "logging_steps": spec["logging"]["every_n_steps"],
        "report_to": "none",
        "save_strategy": "no",
        "eval_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": use_cpu,
    }
    if checkpointing:
        settings = checkpointing if isinstance(checkpointing, dict) else {}
        # the Trainer checkpoints every layer; jobspec's `every_n_layers > 1` has no Trainer equivalent
        kwargs[checkpointing_kwargs_name] = {"use_reentrant": settings.get("use_reentrant", False)}
    if optimizer["name"] == "sgd":
        kwargs["optim_args"] = f"momentum={optimizer['momentum']}"
    if deepspeed:
        kwargs["deepspeed"] = ds_config
    return kwargs


def read_run_dir(run_dir: Path) -> tuple[dict, dict, dict]:
    """(resolved spec, ds_config, derived) of a `jobspec compile --out` directory."""
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text(encoding="utf-8"))
    ds_config = json.loads((run_dir / "ds_config.json").read_text(encoding="utf-8"))
    derived = json.loads((run_dir / "launch.json").read_text(encoding="utf-8"))["derived"]
    return spec, ds_config, derived


def steady_windows(step_ends: list[float], start: float, window: int) -> list[float]:
    """Seconds per window of `window` steps from step-end timestamps; the first window is warm-up."""
    marks = [start] + step_ends
    durations = [marks[i + window] - marks[i] for i in range(0, len(marks) - window, window)]
    return durations[1:] or durations


def make_callback(window: int, device):
    """A TrainerCallback timing optimizer steps and reading memory at window ends (like the worker)."""
    from transformers import TrainerCallback

    from jobspec.train import metrics

    class SteadyState(TrainerCallback):
        def __init__(self):
            self.started = None
            self.step_ends: list[float] = []
            self.memory: dict[str, float] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                import torch
                torch.cuda.synchronize(device)  # the worker's window ends in a collective: a sync too
            self.step_ends.append(time.perf_counter())
            if len(self.step_ends) % window == 0:
                for name, value in metrics.reduce_max(metrics.memory_snapshot(device)).items():
                    self.memory[name] = max(value, self.memory.get(name, value))

    return SteadyState()


def loss_counts_items(model, batch: dict) -> bool:
    """Whether `model`'s loss divides by the `num_items_in_batch` the Trainer hands it.

    transformers' Trainer assumes so for every model whose forward takes **kwargs, and then leaves
    out its own division by the accumulation steps. BERT's heads take **kwargs but average over
    their own micro-batch: such a model trains on accumulation x the mean gradient, which gradient
    clipping and Adam's epsilon do not ignore (the smallest gradients, attention's query and key
    at a fresh initialisation, are of epsilon's size). Two forwards in eval mode (no dropout): the
    batch's loss without a count and with twice its labelled count."""
    import torch

    labels = batch["labels"]
    doubled = torch.tensor(2 * int(labels.ne(-100).sum()), device=labels.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            plain = model(**batch).loss
            counted = model(**batch, num_items_in_batch=doubled).loss
    except TypeError:   # a forward without **kwargs: the Trainer divides by the steps itself
        return False
    finally:
        model.train(was_training)
    return not torch.equal(plain, counted)


def jobspec_like_trainer(model, args, train_dataset, *, shuffle: bool, **kwargs):
    """transformers' Trainer training as a jobspec job does: its loss divided by the accumulation
    steps unless the model's own loss divides by the Trainer's item count (`loss_counts_items`),
    and without `data.shuffle` the samples in file order (the worker's order then)."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer

    class JobspecLikeTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            if shuffle:
                return super()._get_train_sampler(train_dataset)
            return SequentialSampler(self.train_dataset if train_dataset is None else train_dataset)

    trainer = JobspecLikeTrainer(model=model, args=args, train_dataset=train_dataset, **kwargs)
    if args.gradient_accumulation_steps > 1:
        device = next(model.parameters()).device   # one sample is enough to tell
        batch = {k: v[:1].to(device) for k, v in next(iter(trainer.get_train_dataloader())).items()}
        trainer.loss_is_scaled_for_ga = loss_counts_items(model, batch)
    return trainer


def run(run_dir: Path, out: Path) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import TrainingArguments, set_seed

    from jobspec.data.loaders import synthetic_dataset
    from jobspec.model.build import build_model
    from jobspec.train import metrics

    spec, ds_config, derived = read_run_dir(run_dir)
    if spec["data"].get("synthetic") is None:
        raise SystemExit("the baseline needs a job with data.synthetic (same token ids on both sides)")
    use_cpu = not torch.cuda.is_available()
    args = TrainingArguments(**training_arguments_kwargs(spec, derived, ds_config, run_dir / "trainer",
                                                         use_cpu=use_cpu))
    set_seed(spec["training"]["seed"])  # the same initial weights as the worker
    model = build_model(spec)
    synthetic = spec["data"]["synthetic"]
    train_ds = synthetic_dataset(spec, synthetic["num_samples"], spec["training"]["seed"])
    window = spec["logging"]["every_n_steps"]
    callback = make_callback(window, args.device)
    trainer = jobspec_like_trainer(model, args, train_ds, shuffle=spec["data"]["shuffle"],
                                   callbacks=[callback])
    trainer.train()

    world = args.world_size
    per_window = steady_windows(callback.step_ends, callback.started, window)
    samples_per_s = statistics.median(derived["global_batch_size"] * window / d for d in per_window)
    # every synthetic sample is seq_len real tokens (no padding): the worker's attention-mask count
    tokens_per_sample = float(train_ds.columns["attention_mask"].sum()) / len(train_ds)
    result = {"perf/samples_per_s": samples_per_s, "perf/tokens_per_s": samples_per_s * tokens_per_sample,
              **{f"mem/{k}_max": v for k, v in callback.memory.items()},
              "windows": len(per_window), "world_size": world}
    device_name = torch.cuda.get_device_name() if not use_cpu else "cpu"
    peak = metrics.peak_flops(device_name, spec["memory"]["precision"])
    if peak:  # absent on CPU, as in the worker
        # the worker's numbers, from the same launch.json: TFLOP/s with recompute, MFU without
        tokens_per_s_device = result["perf/tokens_per_s"] / world
        result.update({"perf/tflops_per_device": derived["hardware_flops_per_token"] * tokens_per_s_device / 1e12,
                       "perf/mfu": derived["model_flops_per_token"] * tokens_per_s_device / peak})
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer_baseline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="a `jobspec compile --out` directory")
    parser.add_argument("--out", type=Path, required=True, help="result JSON (written by rank 0)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help="set by the deepspeed runner")
    args = parser.parse_args(argv)
    run(args.run_dir.resolve(), args.out.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
