"""The training worker: one process per rank, started by the deepspeed runner.

    deepspeed --num_gpus N --master_port P --module jobspec.worker --run-dir DIR

It reads only the run directory (resolved.yaml, ds_config.json, patches.json, launch.json) and
the environment the runner sets; builds tokenizer, model, patches and data; trains for
`derived.total_steps` optimizer steps through `deepspeed.initialize`; logs metrics (rank 0, via
MetricSink), saves checkpoints, resumes from them, and stops cleanly on SIGUSR1/SIGTERM.
Rank 0 writes `summary.json`. Env: JOBSPEC_PROGRESS=bar|lines|none, JOBSPEC_STOP_AFTER_STEPS=K
(behave as if signalled after K steps: for tests and debugging).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from jobspec.errors import EXIT_INVALID, SpecError, spec_error

RUN_FILES = ("resolved.yaml", "ds_config.json", "patches.json", "launch.json")


@dataclass
class RunFiles:
    spec: dict
    ds_config: dict
    patches: list
    launch: dict

    @property
    def derived(self) -> dict:
        return self.launch["derived"]


def read_run_dir(run_dir: Path) -> RunFiles:
    missing = [name for name in RUN_FILES if not (run_dir / name).is_file()]
    if missing:
        raise spec_error(f"run directory {run_dir} lacks {', '.join(missing)}",
                         hint="create it with `jobspec compile --out DIR` or `jobspec launch`")
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text(encoding="utf-8"))
    loaded = [json.loads((run_dir / name).read_text(encoding="utf-8")) for name in RUN_FILES[1:]]
    files = RunFiles(spec, *loaded)
    if "total_steps" not in files.launch.get("derived", {}):
        raise spec_error(f"{run_dir / 'launch.json'} has no derived.total_steps",
                         hint="recompile the job with this version of jobspec")
    return files


class StopFlag:
    """Set by SIGUSR1/SIGTERM (Slurm's warning, a preemption); acted on at a step boundary."""

    def __init__(self):
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


@dataclass
class Window:
    """What happened since the last log step, kept on device so no step waits for a sync."""

    loss_sum: object = None
    micro_batches: int = 0
    samples: int = 0
    tokens: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass
class RunState:
    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples: int = 0                 # global samples trained in this run (not before a resume)
    last_loss: float | None = None
    eval_loss: float | None = None
    samples_per_s: list = field(default_factory=list)
    peak_memory: dict = field(default_factory=dict)
    resumed_from: str | None = None
    last_checkpoint: str | None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobspec.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory written by compile/launch")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed runner")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    started = time.time()
    state = RunState()
    try:
        return train(run_dir, args.local_rank, state, started)
    except SpecError as err:
        _write_failure(run_dir, state, started, err.render())
        print(err.render(), file=sys.stderr)
        return EXIT_INVALID
    except BaseException as err:
        _write_failure(run_dir, state, started, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise
    finally:
        _destroy_process_group()


def train(run_dir: Path, local_rank: int, state: RunState, started: float) -> int:
    files = read_run_dir(run_dir)
    spec, derived = files.spec, files.derived
    stop = StopFlag()
    stop.install()

    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import set_seed

    from jobspec import checkpointing
    from jobspec.data import build_datasets, make_loader
    from jobspec.model import build_model, build_tokenizer
    from jobspec.patches import apply_patches, build_client_optimizer
    from jobspec.progress import NullProgress, Progress

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    _share_cpu_threads()
    training = spec["training"]
    set_seed(training["seed"])  # python, numpy, torch (+cuda): same initial weights on every rank

    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer)
    model, patch_notes = apply_patches(model, files.patches)
    client_optimizer = None
    for patch in files.patches:
        if patch["name"] == "client_optimizer":
            client_optimizer = build_client_optimizer(model, patch["args"])
    train_ds, eval_ds = build_datasets(spec, tokenizer)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=client_optimizer, config=files.ds_config)

    ckpt = spec["checkpoint"]
    target = checkpointing.resume_target(ckpt["resume"], ckpt["dir"])
    pending_rng = None
    if target is not None:
        client_state = checkpointing.load(engine, *target)
        pending_rng = checkpointing.rng_state_of_this_rank(client_state)
        state.step = client_state["step"]
        state.epoch = client_state["epoch"]
        state.batches_in_epoch = client_state["batches_in_epoch"]
        state.resumed_from = str(Path(target[0]) / target[1])

    data = spec["data"]
    loader_args = dict(micro_batch_size=derived["micro_batch_size"], rank=rank, world_size=world,
                       seed=training["seed"], num_workers=data["num_workers"], pin_memory=data["pin_memory"])
    total_steps = derived["total_steps"]
    stop_after = int(os.environ.get("JOBSPEC_STOP_AFTER_STEPS", "0") or 0)
    progress = Progress(total_steps, state.step) if rank == 0 else NullProgress()
    sink = _open_sink(run_dir) if rank == 0 else None
    telemetry = Telemetry(engine, spec, derived, files.patches, sink, progress, rank, state)
    for note in patch_notes:
        progress.message(note)
    if state.resumed_from:
        progress.message(f"resumed from {state.resumed_from} at step {state.step}")

    def save_checkpoint():
        state.last_checkpoint = checkpointing.save(
            engine, ckpt["dir"], step=state.step, epoch=state.epoch, batches_in_epoch=state.batches_in_epoch,
            job_name=spec["name"], keep_last=ckpt["keep_last"])
        progress.message(f"checkpoint {state.last_checkpoint} saved to {ckpt['dir']}")

    def run_eval():
        if eval_ds is None:
            return
        loader = make_loader(eval_ds, epoch=0, shuffle=False, skip_batches=0, **loader_args)
        state.eval_loss = evaluate(engine, loader)
        telemetry.log_eval(state.step, state.eval_loss)

    engine.train()
    window = Window()
    status = "finished"
    empty_epochs = 0
    while state.step < total_steps and status != "preempted":
        loader = make_loader(train_ds, epoch=state.epoch, shuffle=data["shuffle"],
                             skip_batches=state.batches_in_epoch, **loader_args)
        yielded = False
        batches = iter(loader)
        if pending_rng is not None:  # after iter(): see checkpointing.rng_state_of_this_rank
            checkpointing.restore_rng_state(pending_rng)
            pending_rng = None
        for batch in batches:
            yielded = True
            window.tokens += telemetry.count_tokens(batch)
            window.samples += int(batch["input_ids"].shape[0])
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            boundary = engine.is_gradient_accumulation_boundary()  # ask before step() advances it
            loss = _loss_of(engine(**batch))
            engine.backward(loss)
            engine.step()
            state.batches_in_epoch += 1
            window.micro_batches += 1
            detached = loss.detach().float()
            window.loss_sum = detached if window.loss_sum is None else window.loss_sum + detached
            if not boundary:
                continue
            state.step += 1
            window.steps += 1
            progress.update(state.step)
            last = state.step >= total_steps
            if state.step % spec["logging"]["every_n_steps"] == 0 or last:
                telemetry.log_window(state.step, window)
                window = Window()
            eval_every = training.get("eval_every")
            if (eval_every and state.step % eval_every == 0) or last:
                run_eval()
            if last:
                break
            if _any_rank(stop.requested or (stop_after and state.step >= stop_after), engine.device):
                if window.steps:
                    telemetry.log_window(state.step, window)
                    window = Window()
                status = "preempted"
                save_checkpoint()
                break
            if ckpt["every_n_steps"] and state.step % ckpt["every_n_steps"] == 0:
                save_checkpoint()
        else:  # the epoch is used up; continue with the next, reshuffled
            empty_epochs = 0 if yielded else empty_epochs + 1
            if empty_epochs > 1:
                raise spec_error("the training data yields no batches", path=("data",),
                                 hint="check the data files and training.micro_batch_size")
            state.epoch += 1
            state.batches_in_epoch = 0
    if status == "finished" and ckpt["save_final"] and state.last_checkpoint != checkpointing.tag_for(state.step):
        save_checkpoint()
    progress.close()
    if rank == 0:
        write_summary(run_dir, summarize(state, status, total_steps, started))
    if sink is not None:
        sink.close(timeout=30)
    return 0


class Telemetry:
    """Turns windows of steps into the shared metric names; collectives run on every rank."""

    def __init__(self, engine, spec, derived, patches, sink, progress, rank, state: RunState):
        import torch

        from jobspec import metrics
        self.engine, self.sink, self.progress, self.rank, self.state = engine, sink, progress, rank, state
        self.metrics = metrics
        self.world = derived["world_size"]
        self.count_tokens = metrics.count_tokens
        checkpointed = next((p["args"].get("every_n_layers", 1) for p in patches
                             if p["name"] == "gradient_checkpointing"), None)
        self.flops_per_token = metrics.flops_per_token(engine.module, _seq_len(spec),
                                                       checkpoint_every_n_layers=checkpointed)
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.peak_flops = metrics.peak_flops(device_name, spec["memory"]["precision"])

    def log_window(self, step: int, window: Window) -> None:
        import torch
        import torch.distributed as dist
        device = self.engine.device
        totals = torch.stack([window.loss_sum.to(device), *(torch.tensor(float(x), device=device) for x in
                              (window.micro_batches, window.samples, window.tokens))])
        dist.all_reduce(totals)  # SUM: also the one sync point that makes the window's time honest
        loss_sum, micro_batches, samples, tokens = totals.tolist()
        elapsed = max(time.perf_counter() - window.started, 1e-9)
        out = {
            "train/loss": loss_sum / micro_batches,
            "train/lr": float(self.engine.get_lr()[0]),
            "perf/step_time_s": elapsed / window.steps,
            "perf/samples_per_s": samples / elapsed,
            "perf/tokens_per_s": tokens / elapsed,
        }
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            out["train/grad_norm"] = float(grad_norm)
        if self.flops_per_token and self.peak_flops:  # both absent where the peak is unknown (CPU)
            flops_per_s = self.flops_per_token * tokens / elapsed / self.world
            out["perf/tflops_per_device"] = flops_per_s / 1e12
            out["perf/mfu"] = flops_per_s / self.peak_flops
        out.update(self.memory())
        self.state.last_loss = out["train/loss"]
        self.state.samples += int(samples)
        self.state.samples_per_s.append(out["perf/samples_per_s"])
        if self.rank == 0:
            self.sink.log(out, step=step)
            self.progress.log(step, out)

    def memory(self) -> dict:
        snapshot = self.metrics.memory_snapshot(self.engine.device)
        highest = self.metrics.reduce_max(snapshot)  # collective: same keys on every rank
        self.metrics.reset_peaks(self.engine.device)  # the next window reports its own peak
        out = {f"mem/{k}_max": float(v) for k, v in highest.items()}
        out.update({f"mem/{k}_rank0": float(snapshot[k]) for k in ("peak_allocated_mib", "peak_reserved_mib")
                    if k in snapshot})
        for name, value in out.items():
            self.state.peak_memory[name] = max(value, self.state.peak_memory.get(name, value))
        return out

    def log_eval(self, step: int, loss: float) -> None:
        if self.rank == 0:
            self.sink.log({"eval/loss": loss}, step=step)
            self.progress.message(f"step {step} eval/loss {loss:.4f}")


def evaluate(engine, loader) -> float:
    """Mean eval loss over every rank's samples."""
    import torch
    import torch.distributed as dist
    totals = torch.zeros(2, device=engine.device)
    engine.eval()
    with torch.no_grad():
        for batch in loader:
            n = batch["input_ids"].shape[0]
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            totals += torch.stack([_loss_of(engine(**batch)).float() * n, torch.tensor(float(n), device=engine.device)])
    engine.train()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


def summarize(state: RunState, status: str, total_steps: int, started: float, error: str | None = None) -> dict:
    # the first window pays for warm-up (allocation, JIT); leave it out when there are others
    steady = state.samples_per_s[1:] or state.samples_per_s
    summary = {
        "status": status,
        "steps": state.step,
        "total_steps": total_steps,
        "samples": state.samples,
        "final_loss": state.last_loss,
        "eval_loss": state.eval_loss,
        "samples_per_s": sum(steady) / len(steady) if steady else None,
        "peak_memory": state.peak_memory,
        "elapsed_s": round(time.time() - started, 3),
        "resumed_from": state.resumed_from,
        "checkpoint": state.last_checkpoint,
    }
    if error is not None:
        summary["error"] = error
    return summary


def write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / "summary.json")


def _write_failure(run_dir: Path, state: RunState, started: float, error: str) -> None:
    if int(os.environ.get("RANK", "0")) != 0 or not run_dir.is_dir():
        return
    try:
        write_summary(run_dir, summarize(state, "failed", None, started, error=error))
    except OSError:
        pass  # the original error matters more than a summary we cannot write


def _any_rank(flag: bool, device) -> bool:
    """True on every rank if it is true on one: all ranks must stop at the same step."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _share_cpu_threads() -> None:
    """On CPU ranks, split the cores between the ranks of this node: every rank taking all of
    them makes the ranks' OpenMP threads fight for cores (steps become many times slower)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def _loss_of(outputs):
    return outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", outputs[0])


def _seq_len(spec: dict) -> int:
    synthetic = spec["data"].get("synthetic")
    return synthetic["seq_len"] if synthetic else spec["data"]["max_length"]


def _open_sink(run_dir: Path):
    from jobspec.telemetry import MetricSink
    return MetricSink.open(run_dir)


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
