"""One job trained under different splits of its global batch, on this process's ranks (issue 32).

`run_files(task, world=, micro=, zero=)`: the run files of a tiny job whose micro-batches hold different
numbers of labelled tokens -- `chat`: a GPT-2 on 64 of the sample chat records with the loss on the answers;
`mlm`: a BERT on synthetic masked-LM data (15% random masks). Global batch 16, fp32, no dropout, SGD
without momentum (its update is the gradient itself: a loss scaled wrongly shows, which Adam's
normalisation would hide), no shuffle, no checkpoint. `train_case(files)` runs the worker's own
`build_engine` and Trainer on the process group already initialised (1 rank in the test process,
2 ranks under tests/train/split_ranks.py) and returns the trained weights and the logged metrics.
"""
from __future__ import annotations

import contextlib
import copy
import os
import socket
import time
from pathlib import Path

from jobspec.rundir import RunFiles
from jobspec.spec.schema import fill_defaults

REPO_ROOT = Path(__file__).resolve().parents[2]

GLOBAL_BATCH = 16
STEPS = 3
DATA = REPO_ROOT / "jobs" / "data"

_COMMON = {
    "name": "split",
    "training": {"max_steps": STEPS, "global_batch_size": GLOBAL_BATCH, "seed": 11, "gradient_clipping": 0.0,
                 "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0},
                 "scheduler": {"name": "constant", "warmup_steps": 0}},
    "checkpoint": {"save_final": False, "every_n_steps": 0},
    "export": {"final": False},
    "logging": {"every_n_steps": 1, "mlflow": {"enabled": False}, "progress": "none"},
    "memory": {"precision": "fp32"},
}
TASKS = {
    "chat": {
        "model": {"architecture": "gpt2", "task": "causal-lm",
                  "config": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 96, "vocab_size": 2048,
                             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
        # the first 64 of jobs/data/chat-sample.jsonl's records: 3 steps of 16 need 48
        "data": {"train": str(REPO_ROOT / "tests" / "assets" / "chat" / "answers-64.jsonl"),
                 "tokenizer": str(DATA / "tokenizer"),
                 "records": "chat", "loss_on": "answers", "max_length": 96, "shuffle": False,
                 "num_workers": 0, "pin_memory": False},
    },
    "mlm": {
        "model": {"architecture": "bert", "task": "masked-lm",
                  "config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                             "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64,
                             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}},
        "data": {"synthetic": {"num_samples": 96, "eval_samples": 0, "seq_len": 24, "vocab_range": [5, 120]},
                 "shuffle": False, "num_workers": 0, "pin_memory": False},
    },
}
TRAIN_ROWS = {"chat": 64, "mlm": 96}


def deep_merge(base: dict, over: dict) -> dict:   # conftest's, without importing conftest on the ranks
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def run_files(task: str, *, world: int, micro: int, zero: int, overrides: dict | None = None) -> RunFiles:
    """The compiled run files of `task` at this split (what `jobspec compile` writes, in memory)."""
    from jobspec.compile.compiler import compile_spec
    from jobspec.spec.derived import derive

    spec = deep_merge(deep_merge(_COMMON, TASKS[task]), {
        "training": {"micro_batch_size": micro}, "memory": {"zero_stage": zero},
        "resources": {"gpus_per_node": world}})
    spec = fill_defaults(deep_merge(spec, overrides or {}))
    spec["output_dir"] = "/nonexistent-split-run"   # nothing is written: no checkpoint, no export
    spec["checkpoint"]["dir"] = spec["output_dir"] + "/checkpoints"
    compiled = compile_spec(spec, derive(spec, num_train_samples=TRAIN_ROWS[task]))
    launch = {**compiled.plan.record(), "derived": compiled.derived.as_dict(), "notes": []}
    return RunFiles(copy.deepcopy(spec), compiled.ds_config, compiled.patches, launch)


@contextlib.contextmanager
def without_unused_ops():
    """DeepSpeed's shm all-reduce op off while engines are built in this process, as on the worker's ranks
    (`ops.skip_unused_ops`): never built (minutes on a new machine) nor loaded; DeepSpeed's table restored
    after (tests/launch/test_ops.py reads it)."""
    import deepspeed.ops

    from jobspec import ops
    table = deepspeed.ops.__compatible_ops__
    saved = dict(table)
    ops.skip_unused_ops()
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


@contextlib.contextmanager
def one_rank_process_group(store: Path):
    """A one-rank gloo process group in this process, with the env the deepspeed runner would set."""
    import torch.distributed as dist
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    forget_deepspeed_groups()   # an earlier test of this process may have left its groups behind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        with without_unused_ops():
            yield
    finally:
        dist.destroy_process_group()
        forget_deepspeed_groups()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class ListSink:
    """rank 0's metric sink, kept in memory."""

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def metric(self, name: str) -> list[float]:
        return [m[name] for _, m in self.rows if name in m]


def trainer(files: RunFiles, engine, train_ds, state, sink, *, run_dir: Path,
            stop_after: int | None = None, pending_rng: dict | None = None,
            environ: dict | None = None):
    """The worker's Trainer of `engine` on `files` with the job's policies (no eval data; the job
    saves no checkpoint and exports nothing), stopping after `stop_after` steps."""
    import torch.distributed as dist

    from jobspec.spec.derived import DerivedJob
    from jobspec.train import assembly
    from jobspec.train.progress import Progress
    from jobspec.train.stopping import STOP_AFTER_ENV, StopFlag, StopVote

    job = DerivedJob.from_dict(files.derived)
    progress = Progress(files.launch["derived"]["total_steps"], mode="none")
    built = assembly.Built(engine, train_ds, None, [], pending_rng, None)
    outputs = assembly.RankOutputs(progress, sink, None)
    stop = StopVote(StopFlag(), None, dist.get_world_size(),
                    environ={STOP_AFTER_ENV: str(stop_after)} if stop_after is not None else {})
    return assembly.trainer_for(files, job, built, outputs, state, run_dir=run_dir, stop=stop,
                                environ=environ or {})


def train_case(files: RunFiles, *, stop_after: int | None = None, resume: bool = False):
    """(weights by name as fp32 CPU tensors, the sink, the state, the engine) after the worker's
    Trainer on `files` (from the checkpoint `checkpoint.resume` names when `resume`)."""
    from jobspec.train import engine as engine_module
    from jobspec.train.progress import RunState

    engine, train_ds, _, _ = engine_module.build_engine(files)
    state = RunState()
    pending_rng = engine_module.resume(engine, files.spec["checkpoint"], state) if resume else None
    sink = ListSink()
    trainer(files, engine, train_ds, state, sink, run_dir=Path(files.spec["output_dir"]),
            stop_after=stop_after, pending_rng=pending_rng).train()
    weights = {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()}
    return weights, sink, state, engine


def train_with_oom(files: RunFiles, run_dir, environ: dict):
    """(weights, sink, the OomGuard) after the Trainer under `training.on_oom` with its injection
    env `environ` (jobspec.train.oom), the engine rebuilt in this process as the worker rebuilds it."""
    from jobspec.train.engine import build_engine
    from jobspec.train.progress import RunState

    engine, train_ds, _, _ = build_engine(files)
    state, sink = RunState(), ListSink()
    made = trainer(files, engine, train_ds, state, sink, run_dir=Path(run_dir), environ=environ)
    del engine   # the Trainer holds the only reference: the recovery frees it
    made.train()
    engine = made.engine
    weights = {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return weights, sink, made.policies.oom


def initial_weights(files: RunFiles) -> dict:
    """The weights every split starts from (the seeded model, before any step)."""
    from jobspec.model.build import build_model, build_tokenizer
    from jobspec.train.engine import seed_everything
    seed_everything(files.spec["training"]["seed"])
    model = build_model(files.spec, build_tokenizer(files.spec), files.ds_config)
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def worst_relative_difference(weights: dict, reference: dict, start: dict) -> float:
    """max over the weights of |weights - reference|, relative to the largest update of the reference
    (max |reference - start|): how much of a step's change the splits disagree on."""
    update = max(float((reference[n] - start[n]).abs().max()) for n in reference)
    return max(float((weights[n] - reference[n]).abs().max()) for n in reference) / update


def timed(fn, *args, **kwargs):
    began = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - began


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the groups it made (world, data parallel, an mpu's) in module globals: forget them,
    so that an engine built on a later process group of this process does not reach for destroyed ones."""
    from deepspeed.utils import groups
    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups.mpu = groups.mesh_device = None
