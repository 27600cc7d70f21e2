"""The worker's model export (spec section `export`): Hugging Face directories while the job runs.

    <export.dir or RUN_DIR/model>/
        final     when training finishes (after the final checkpoint)
        step<N>   after each checkpoint (`at_checkpoints`), newest keep_last kept
        best      at each new best evaluation (`best_eval`) of `best_metric`: the lowest loss or
                  perplexity, the highest accuracy or F1

Every export is collective: all ranks take part in gathering the weights, rank 0 writes
(jobspec/export/hf_dir.py), and rank 0's outcome is broadcast so that a failed write stops every
rank at the same point with the same one-line error (`ExportFailed`: the worker exits 1). When a
checkpoint is due at the step of an export, it is saved first (a best-eval export waits for it), so
a full disk loses no checkpoint; an export directory that cannot be written at all fails at start.

Weights: under ZeRO-3 DeepSpeed's own consolidation (`engine._zero3_consolidated_16bit_state_dict`,
what `save_16bit_model` runs with `stage3_gather_16bit_weights_on_model_save`: one layer at a time
through `GatheredParameters`, CPU/NVMe-offloaded parameters included); under ZeRO 0-2 every rank
holds the whole module. Those are the weights the engine computes with (16-bit under fp16/bf16).
`export.dtype: fp32` after 16-bit training gathers DeepSpeed's fp32 master weights instead
(`deepspeed.utils.safe_get_full_fp32_param`, ZeRO 1-3).

Every checkpoint also gets a copy of the run's resolved.yaml (`<tag>/jobspec_resolved.yaml`), so
that `jobspec export` can rebuild the model of any checkpoint without its run directory, and, when
the training data's labels are names ("positive", "B-PER"), their ids (`<tag>/jobspec_labels.json`):
every exported config.json carries them as id2label/label2id, so a pipeline answers with the user's
names.

Test hook: JOBSPEC_EXPORT_REFERENCE=DIR makes every rank run the engine on a fixed batch at each
checkpoint and at the end, and rank 0 save the logits to DIR/step<N>.pt and DIR/final.pt: an
engine-side reference for the exported weights.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from jobspec import rundir
from jobspec.errors import spec_error
from jobspec.export import lora as lora_exports
from jobspec.export.hf_dir import (
    ExportFailed,
    ExportInfo,
    describe_io_error,
    job_tokenizer,
    write_model_dir,
)
from jobspec.export.rules import resolve_dtype
from jobspec.spec.derived import DerivedJob
from jobspec.spec.types import JobSpec
from jobspec.tasks import metrics as eval_metrics
from jobspec.units import MiB

CHECKPOINT_SPEC = "jobspec_resolved.yaml"
# string labels -> ids of the data the checkpoint trained on
CHECKPOINT_LABELS = "jobspec_labels.json"
REFERENCE_ENV = "JOBSPEC_EXPORT_REFERENCE"
_STEP_DIR = re.compile(r"^step(\d+)$")


class ModelExporter:
    """The export policy: called by the Trainer's checkpointer after each checkpoint, by its
    evaluator after each evaluation, and at the end of a finished run; records go to
    `state.exports`."""

    def __init__(self, spec: JobSpec, job: DerivedJob, run_dir: Path, rank: int, group, progress,
                 label_names: dict | None = None):
        self.spec, self.run_dir, self.rank = spec, Path(run_dir), rank
        self.group, self.progress = group, progress
        self.settings = self.spec["export"]
        # rundir.read_run_files refuses a launch.json without it
        assert job.total_steps is not None
        self.total_steps, self.world_size = job.total_steps, job.world_size
        self.base = rundir.export_dir(self.spec, self.run_dir)
        self.dtype = resolve_dtype(self.spec)
        self.label_names = label_names   # string labels -> ids: config.json's label2id/id2label
        self.best_metric = self.settings["best_metric"]
        self.best_value: float | None = None
        if self.settings["best_eval"]:
            check_best_metric(self.spec, label_names)
        # a best export waiting for this step's checkpoint
        self._best_pending_at: int | None = None
        self._tokenizer = None
        self._tokenizer_note: str | None = None
        self._tokenizer_loaded = False

    @property
    def active(self) -> bool:
        return bool(self.settings["final"] or self.settings["at_checkpoints"]
                    or self.settings["best_eval"])

    # --- events -----------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Before training: a directory that cannot be written fails now, not after hours of
        training."""
        if not self.active:
            return
        error = None
        if self.rank == 0:
            try:
                self.base.mkdir(parents=True, exist_ok=True)
                probe = self.base / f".jobspec-write-test-{os.getpid()}"
                probe.write_text("ok", encoding="utf-8")
                probe.unlink()
            except OSError as err:
                # the file in the way, not its child
                if isinstance(err, (FileExistsError, NotADirectoryError)):
                    err.filename = str(next(p for p in (self.base, *self.base.parents)
                                            if p.exists()))
                error = describe_io_error(self.base, err)
        self._raise_if(self._broadcast(error))

    def after_checkpoint(self, engine, state, ckpt_dir: str) -> None:
        tag = state.last_checkpoint
        if self.rank == 0 and tag:
            _copy_spec(self.run_dir, Path(ckpt_dir) / tag)
            if self.label_names:   # `jobspec export` of this checkpoint names the labels too
                write_label_names(Path(ckpt_dir) / tag, self.label_names)
        _save_reference(engine, self.spec, f"step{state.step}", self.rank)
        if self._best_pending_at == state.step:
            self._best_pending_at = None
            self._export(engine, state, "best", "best evaluation")
        last = state.step >= self.total_steps
        if self.settings["at_checkpoints"] and not (last and self.settings["final"]):
            self._export(engine, state, f"step{state.step}", "checkpoint")
            if self.rank == 0:
                self._prune(keep=self.spec["checkpoint"]["keep_last"], state=state)

    def after_eval(self, engine, state) -> None:
        if not self.settings["best_eval"]:
            return
        name = self.best_metric
        value = state.eval_loss if name == "loss" else state.eval_metrics.get(name)
        # NaN or a missing value never wins
        if eval_metrics.improves(name, value, self.best_value):
            self.best_value = value
            if self._checkpoint_follows(state.step):   # same weights: export right after that save
                self._best_pending_at = state.step
            else:
                self._export(engine, state, "best", "best evaluation")

    def _checkpoint_follows(self, step: int) -> bool:
        """Whether a checkpoint is saved at `step` after its evaluation (the rule of
        train/checkpointer.Checkpointer.due)."""
        ckpt = self.spec["checkpoint"]
        every = ckpt["every_n_steps"]
        periodic = step % every == 0 if every else False
        return periodic or (step >= self.total_steps and ckpt["save_final"])

    def final(self, engine, state) -> None:
        _save_reference(engine, self.spec, "final", self.rank)
        if self.settings["final"]:
            self._export(engine, state, "final", "end of training")

    # --- the collective export --------------------------------------------------------------------

    def _export(self, engine, state, name: str, why: str) -> None:
        state_dict, notes = gather_state_dict(engine, self.dtype, self.spec["memory"]["precision"],
                                              self.rank)
        error = None
        if self.rank == 0:
            out = self.base / name
            metrics = {k: v
                       for k, v in (("train/loss", state.last_loss), ("eval/loss", state.eval_loss))
                       if v is not None}
            metrics.update({eval_metrics.key(k): v for k, v in state.eval_metrics.items()})
            info = ExportInfo(name=name, step=state.step, dtype=self.dtype,
                              source=f"the training run ({why})",
                              metrics=metrics, notes=notes
                              + ([self._tokenizer_note] if self._tokenizer_note else []),
                              world_size=self.world_size)
            if state_dict is None:
                # gather_state_dict gives rank 0 one
                raise RuntimeError("rank 0 gathered no state dict")
            try:
                merged, adapter = lora_exports.wanted(self.spec)
                # the PEFT model: checked, then split (export/lora.py)
                if self.spec["model"]["lora"]:
                    peft_model, _ = lora_exports.split(self.spec, state_dict, self.dtype,
                                                       "the ranks (ZeRO stage "
                                                       f"{self.spec['memory']['zero_stage']})")
                    if adapter:
                        self._record(state, f"{name}{lora_exports.ADAPTER_SUFFIX}",
                                     lora_exports.write_adapter_dir(
                            self.base / f"{name}{lora_exports.ADAPTER_SUFFIX}", self.spec,
                            peft_model,
                            {"name": name, "step": state.step, "dtype": self.dtype,
                             "source": info.source},
                            tokenizer=self._job_tokenizer()))
                    state_dict = lora_exports.merged_state_dict(peft_model) if merged else {}
                    del peft_model
                if merged:
                    self._record(state, name, write_model_dir(out, self.spec, state_dict, info,
                                                              tokenizer=self._job_tokenizer(),
                                                              label_names=self.label_names))
            except lora_exports.GatherMismatch as err:
                error = str(err)
            # the adapter directory (write_model_dir raises ExportFailed itself)
            except OSError as err:
                error = describe_io_error(self.base / f"{name}{lora_exports.ADAPTER_SUFFIX}", err)
            except ExportFailed as err:
                error = str(err)
        del state_dict
        self._raise_if(self._broadcast(error))

    def _record(self, state, name: str, record: dict) -> None:
        state.exports[name] = {k: record[k] for k in ("path", "step", "dtype", "bytes", "seconds")}
        self.progress.message(f"model ({name}) exported to {record['path']} "
                              f"({record['bytes'] / MiB:.1f} MiB, {record['seconds']:.1f} s)")

    def _job_tokenizer(self):
        if not self._tokenizer_loaded:
            self._tokenizer, self._tokenizer_note = job_tokenizer(self.spec)
            self._tokenizer_loaded = True
        return self._tokenizer

    def _prune(self, keep: int, state) -> None:
        steps = sorted(int(m.group(1)) for p in self.base.iterdir() if p.is_dir()
                       and (m := _STEP_DIR.match(p.name)))
        for step in steps[:max(0, len(steps) - keep)]:
            for name in (f"step{step}", f"step{step}{lora_exports.ADAPTER_SUFFIX}"):
                shutil.rmtree(self.base / name, ignore_errors=True)
                state.exports.pop(name, None)

    def _broadcast(self, obj):
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _raise_if(self, error: str | None) -> None:
        if error:
            raise ExportFailed(f"{error}; the checkpoints in {self.spec['checkpoint']['dir']} are "
                               f"intact (`jobspec export` converts one later)")


def check_best_metric(spec: JobSpec, label_names: dict | None) -> None:
    """What validation could not tell before the data was read: the entity F1 of token
    classification needs BIO tags among the training data's labels. SpecError otherwise (exit 2)."""
    task, name = spec["model"]["task"], spec["export"]["best_metric"]
    if (task, name) in eval_metrics.BIO_ONLY and not eval_metrics.is_bio(label_names or {}):
        found = ", ".join(sorted(label_names or {})[:6]) or "integer class ids"
        raise spec_error(f"`best_metric: {name}` is the entity F1 of BIO tags (O, B-TYPE, I-TYPE), "
                         f"but the training labels are {found}", path=("export", "best_metric"),
                         hint="use `best_metric: accuracy` (token accuracy) or `loss`, or label "
                              "the words with BIO tags")


def write_label_names(tag_dir: Path, label_names: dict) -> None:
    try:
        (tag_dir / CHECKPOINT_LABELS).write_text(json.dumps(label_names, indent=1) + "\n",
                                                 encoding="utf-8")
    except OSError:
        pass   # the export of this checkpoint then numbers its labels LABEL_<id>


def read_label_names(tag_dir: Path) -> dict | None:
    """The label names an exporter wrote next to a checkpoint (None: integer labels, or an older
    one)."""
    try:
        names = json.loads((Path(tag_dir) / CHECKPOINT_LABELS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return names if isinstance(names, dict) else None


def gather_state_dict(engine, dtype: str, precision: str, rank: int) -> tuple[dict | None, list]:
    """The full state dict on rank 0 (None elsewhere), and notes for the model card. Collective."""
    from jobspec.model.quantize import dequantized_state_dict, is_quantized
    if engine.zero_optimization_partition_weights():
        state_dict = engine._zero3_consolidated_16bit_state_dict()
    elif rank == 0 and is_quantized(engine.module):
        import torch

        # QLoRA: the base dequantised (model/quantize.py), then cast to the export dtype like the
        # rest
        state_dict = dequantized_state_dict(engine.module, torch.float32)
    else:
        state_dict = engine.module_state_dict() if rank == 0 else None
    notes = []
    if dtype == "fp32" and precision != "fp32":
        missing = _replace_with_fp32_masters(engine, state_dict, rank)
        if missing:
            notes.append(f"{missing} trained parameter(s) had no fp32 master copy to gather (ZeRO "
                         f"stage 0 keeps none outside its optimizer): saved from their {precision} "
                         "weights")
    return state_dict, notes


def _replace_with_fp32_masters(engine, state_dict: dict | None, rank: int) -> int:
    """Put DeepSpeed's fp32 master weights in place of the 16-bit ones (tied names share one
    tensor)."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    aliases: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    missing = 0
    # the same order on every rank: each call is collective
    for _, param in module.named_parameters():
        if not param.requires_grad:
            continue
        full = safe_get_full_fp32_param(param)
        if full is None:
            missing += 1
            continue
        if rank == 0 and state_dict is not None:   # rank 0 holds the full state dict
            shaped = full.detach().reshape(getattr(param, "ds_shape", param.shape)).cpu()
            for alias in aliases[id(param)]:
                key = alias if alias in state_dict else f"_orig_mod.{alias}"
                state_dict[key] = shaped
    return missing


def _copy_spec(run_dir: Path, tag_dir: Path) -> None:
    try:
        shutil.copyfile(run_dir / rundir.RESOLVED, tag_dir / CHECKPOINT_SPEC)
    except OSError:
        pass   # `jobspec export` also finds the spec through the run directories (or --spec)


def reference_batch(spec: JobSpec, vocab_size: int, batch: int = 4):
    """A fixed batch, the same in every process: token ids inside the training data's range."""
    import torch
    synthetic = spec["data"]["synthetic"]
    seq_len = synthetic["seq_len"] if synthetic else min(spec["data"]["max_length"], 32)
    low, high = synthetic["vocab_range"] if synthetic else (5, vocab_size)
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(low, min(high, vocab_size), (batch, seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _save_reference(engine, spec: JobSpec, name: str, rank: int) -> None:
    directory = os.environ.get(REFERENCE_ENV)
    if not directory:
        return
    import torch
    config = engine.module.config
    vocab = config.vocab_size if hasattr(config, "vocab_size") else config.to_dict()["vocab_size"]
    batch = reference_batch(spec, vocab)
    engine.eval()
    with torch.no_grad():
        outputs = engine(**{k: v.to(engine.device) for k, v in batch.items()})
    engine.train()
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    if rank == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save({**batch, "logits": logits.detach().float().cpu(), "dtype": str(logits.dtype)},
                   Path(directory) / f"{name}.pt")
