"""Per-rank bytes of the model-state tensors a real DeepSpeed engine holds (for tests/memory/test_planner_engine.py).

Run under the deepspeed runner:
    deepspeed --num_gpus 2 tests/assets/engine_memory.py --run-dir DIR [--run-dir DIR2 ...]
Each DIR holds `resolved.yaml` and `ds_config.json` (as `jobspec compile --out` writes them); one launch
measures them one after another (one process start-up for all; put a ZeRO-3 one last). For each, the
script builds the spec's model from its config, `deepspeed.initialize`s it, runs one full step (so the
optimizer creates its lazily allocated state) and the forward/backward of a second one. It takes
snapshots just before the second `engine.step()` (parameters, gradients, master weights and optimizer
states all coexist) and, where the ZeRO optimizer reduces gradients at the boundary (stage 1), just
before that reduce (the full gradients are still there), and writes the larger one to
`memory-rank<R>.json`: bytes per category.

Tensors are found through the engine's and the optimizer's attributes (recursively: lists, dicts,
the ZeRO optimizer's buckets) and deduplicated by storage, so a flat buffer and the parameter views
into it count once. The category is taken from the attribute path that reaches the storage first,
in the order module -> optimizer wrapper -> inner optimizer state.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import yaml
import transformers
from transformers import AutoConfig

# Attribute names (substrings, first match wins) -> planner category.
CATEGORIES = (
    ("ipg", "buffers"), ("bucket", "buffers"), ("temp_grad", "buffers"), ("param_buffer_of_bit16", "buffers"),
    ("grad", "gradients"),
    ("fp32", "master_weights"),
    ("state", "optimizer_states"),
    ("bit16", "parameters"), ("fp16", "parameters"), ("lp_param", "parameters"),
)
AUTO_MODELS = {"sequence-classification": "AutoModelForSequenceClassification",
               "token-classification": "AutoModelForTokenClassification",
               "masked-lm": "AutoModelForMaskedLM", "causal-lm": "AutoModelForCausalLM"}
_SKIP_ATTRS = {"module", "_modules", "dp_process_group", "real_dp_process_group", "timers", "loss_scaler",
               "param_names", "param_dict", "params_in_ipg_bucket", "extra_large_param_to_reduce"}


def category_of(path: str) -> str:
    lowered = path.lower()
    for needle, category in CATEGORIES:
        if needle in lowered:
            return category
    return "other"


class Collector:
    def __init__(self):
        self.seen: dict[tuple, str] = {}      # storage key -> category
        self.bytes: dict[str, int] = {}
        self.where: dict[str, list] = {}

    def add(self, tensor: torch.Tensor, path: str, category: str | None = None) -> None:
        if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = (storage.data_ptr(), storage.nbytes())
        if key in self.seen:
            return
        category = category or category_of(path)
        self.seen[key] = category
        self.bytes[category] = self.bytes.get(category, 0) + storage.nbytes()
        self.where.setdefault(category, []).append([path, storage.nbytes()])

    def walk(self, value, path: str, depth: int = 0, category: str | None = None) -> None:
        if depth > 4:
            return
        if isinstance(value, torch.Tensor):
            self.add(value, path, category)
            grad = value.grad if value.is_leaf else None
            if grad is not None:
                self.add(grad, path + ".grad", "gradients")
            return
        if isinstance(value, dict):
            for index, (key, item) in enumerate(list(value.items())):
                label = key if isinstance(key, (str, int)) else index   # a tensor key's repr says "grad"
                self.walk(item, f"{path}[{label}]", depth + 1, category)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                self.walk(item, f"{path}[{index}]", depth + 1, category)
        elif hasattr(value, "buffer") and hasattr(value, "index"):   # ZeRO's IPG bucket objects
            self.walk(value.buffer, path + ".buffer", depth + 1, "buffers")


def collect(engine) -> Collector:
    found = Collector()
    for name, param in engine.module.named_parameters():
        partition = getattr(param, "ds_tensor", None)     # ZeRO-3: the rank's partition
        if partition is not None:
            found.add(partition, f"module.{name}.ds_tensor", "parameters")
        found.add(param.data, f"module.{name}", "parameters")
        if param.grad is not None:
            found.add(param.grad, f"module.{name}.grad", "gradients")
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", None)
    for attr, value in vars(wrapper).items():
        if attr in _SKIP_ATTRS or attr == "optimizer":
            continue
        found.walk(value, f"optimizer.{attr}")
    holder = inner if inner is not None else wrapper
    for param, state in holder.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:   # `step` counters are not memory
                found.add(value, f"optimizer.state.{key}", "optimizer_states")
    for group in holder.param_groups:
        for param in group["params"]:
            found.add(param, "optimizer.param_groups.param", "master_weights")
            if param.grad is not None:
                found.add(param.grad, "optimizer.param_groups.param.grad", "gradients")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True, type=Path, action="append")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    from jobspec import ops
    ops.skip_unused_ops()   # as the worker: DeepSpeed's shm all-reduce op, unused in training, not built
    deepspeed.init_distributed(dist_backend="gloo")
    for run_dir in args.run_dir:
        measure(run_dir)
        gc.collect()
    dist.destroy_process_group()


def measure(run_dir: Path) -> None:
    spec = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    torch.manual_seed(0)
    model_spec = spec["model"]
    config = AutoConfig.for_model(model_spec["architecture"], num_labels=model_spec["num_labels"],
                                  **model_spec["config"])
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    model = getattr(transformers, AUTO_MODELS[model_spec["task"]]).from_config(config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    micro, seq = ds_config["train_micro_batch_size_per_gpu"], spec["data"]["synthetic"]["seq_len"]
    generator = torch.Generator().manual_seed(dist.get_rank())

    def forward_backward():
        ids = torch.randint(5, config.vocab_size, (micro, seq), generator=generator).to(engine.device)
        classes = config.vocab_size if model_spec["task"] in ("masked-lm", "causal-lm") else model_spec["num_labels"]
        shape = (micro,) if model_spec["task"] == "sequence-classification" else (micro, seq)
        labels = torch.randint(0, classes, shape, generator=generator).to(engine.device)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)

    for _ in range(engine.gradient_accumulation_steps()):
        forward_backward()
        engine.step()
    snapshots = []
    reduce = getattr(engine.optimizer, "reduce_gradients", None)
    if reduce is not None:
        # ZeRO-1 holds the full gradients until this boundary reduce: its model-state peak
        def snapshot_then_reduce(*args, **kwargs):
            snapshots.append(collect(engine))
            return reduce(*args, **kwargs)
        engine.optimizer.reduce_gradients = snapshot_then_reduce
    for _ in range(engine.gradient_accumulation_steps()):
        forward_backward()
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
    snapshots.append(collect(engine))
    found = max(snapshots, key=lambda c: sum(v for k, v in c.bytes.items() if k != "buffers"))
    engine.step()
    rank = dist.get_rank()
    out = {"rank": rank, "world_size": dist.get_world_size(), "bytes": found.bytes,
           "num_parameters": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                 for p in engine.module.parameters()),
           "tensors": found.where, "optimizer": type(engine.optimizer).__name__}
    (run_dir / f"memory-rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
