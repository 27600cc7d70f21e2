"""`jobspec export`: a saved checkpoint -> a Hugging Face model directory, offline, on the CPU, no
ranks.

The weights come from DeepSpeed's own converter, `deepspeed.utils.zero_to_fp32`, which merges the
fp32 master partitions of every rank of a ZeRO 1-3 checkpoint, whatever the world size (lazily for
ZeRO-3: one parameter is assembled at a time, the shards are memory-mapped). A ZeRO-0 checkpoint
holds the whole module in `mp_rank_00_model_states.pt` (its training dtype). Parameters the
optimizer does not own under ZeRO 1-2 (frozen ones) come from that same module file.

The model they go into is rebuilt from the job's resolved spec (config.json, key names): the copy
every checkpoint carries (`<tag>/jobspec_resolved.yaml`), else the run directories of the job, else
`--spec`.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from jobspec import rundir
from jobspec.errors import first_line, spec_error
from jobspec.export.exporter import CHECKPOINT_SPEC, read_label_names
from jobspec.export.hf_dir import ExportInfo, job_tokenizer, write_model_dir
from jobspec.export.rules import resolve_dtype
from jobspec.spec.types import JobSpec

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


@dataclass
class Source:
    load_dir: Path          # the checkpoint directory (holds `latest` and the step<N> tags)
    tag: str
    spec: JobSpec
    run_dir: Path | None    # a run directory of the job, for the metrics of the model card

    @property
    def path(self) -> Path:
        return self.load_dir / self.tag


def locate(source: str | Path, spec_file: str | Path | None = None) -> Source:
    """The checkpoint a run directory, a checkpoint directory (its `latest`) or a step<N> directory
    names."""
    from jobspec.checkpoint import save_load
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise spec_error(f"{source} does not exist",
                         hint="give a run directory, a checkpoint directory "
                                                          "(with a `latest` file) or one step<N> "
                                                          "checkpoint")
    run_dir = None
    if (path / rundir.RESOLVED).is_file() and not _has_model_states(path):
        run_dir = path
        spec = _read_spec(path / rundir.RESOLVED)
        load_dir = Path(spec["checkpoint"]["dir"])
        tag = save_load.read_latest(load_dir)
        if tag is None:
            raise spec_error(f"run directory {path} has no checkpoint: {load_dir} holds no "
                             "`latest` file",
                             hint="export a run that saved a checkpoint (checkpoint.save_final or "
                                  "every_n_steps)")
    elif (latest := save_load.read_latest(path)) and not _has_model_states(path):
        load_dir, tag = path, latest
    elif _has_model_states(path):
        load_dir, tag = path.parent, path.name
    else:
        raise spec_error(f"{path} is not a run directory, a checkpoint directory or a checkpoint",
                         hint="a run directory holds resolved.yaml, a checkpoint directory a "
                              "`latest` file, a checkpoint (step<N>) DeepSpeed's *_model_states.pt "
                              "files")
    if not _has_model_states(load_dir / tag):
        raise spec_error(f"checkpoint {load_dir / tag} has no DeepSpeed model states "
                         f"({' or '.join(MODEL_STATES)})",
                         hint="a `_universal` directory is a conversion for resuming: export the "
                              "step<N> checkpoint it was made from")
    problem = save_load.verify(load_dir, tag) if (load_dir / tag / save_load.MANIFEST).is_file() \
        else None
    if problem:
        raise spec_error(f"checkpoint {load_dir / tag} is incomplete: {problem}",
                         hint="export an older checkpoint of the job (its step<N> directory)")
    if spec_file is not None:
        spec = _read_spec(Path(spec_file).expanduser())
    elif run_dir is None:
        spec = _spec_of_checkpoint(load_dir, tag)
    if run_dir is None:
        run_dir = next(iter(_run_dirs(spec, load_dir)), None)
    return Source(load_dir, tag, spec, run_dir)


def export_checkpoint(source: Source, out: Path, dtype: str | None = None,
                      show_progress: bool = True) -> dict:
    """Convert `source` into the model directory `out`; returns its record."""
    spec = source.spec
    dtype = resolve_dtype(spec, dtype)
    client = _model_states(source.path)
    step = client.get("step")
    state_dict, notes = consolidated_state_dict(source.path, client, spec["memory"]["precision"],
                                                dtype)
    tokenizer, note = job_tokenizer(spec)
    if note:
        notes.append(note)
    info = ExportInfo(name=out.name, step=step, dtype=dtype, source=f"checkpoint {source.path}",
                      metrics=_metrics_at(source.run_dir, step), notes=notes,
                      world_size=_world_size(client, source.run_dir))
    if spec["model"]["lora"]:
        return _export_lora(source, out, spec, state_dict, info, tokenizer, show_progress)
    return write_model_dir(out, spec, state_dict, info, tokenizer=tokenizer,
                           show_progress=show_progress, label_names=read_label_names(source.path))


def _export_lora(source: Source, out: Path, spec: JobSpec, state_dict: dict, info: ExportInfo,
                 tokenizer, show_progress: bool) -> dict:
    """A LoRA job's checkpoint: the PEFT model's weights checked against the spec's model wrapped by
    apply_lora (count, names, shapes), then, by `export.adapter`, the merged model in `out` and the
    PEFT adapter inside it in `out/adapter`, or only the adapter, in `out` (export/lora.py):
    nothing outside `out`. The record is the merged directory's (the adapter's when only it is
    written), with `adapter`: the adapter's record."""
    from jobspec.export import lora as lora_exports
    from jobspec.export.hf_dir import ExportFailed, describe_io_error

    merged, adapter = lora_exports.wanted(spec)
    # QLoRA: the saved 4-/8-bit base dequantised (model/quantize.py)
    if spec["model"]["quantization"]:
        import torch

        from jobspec.model.quantize import dequantize_saved
        state_dict = dequantize_saved(state_dict, torch.float32)
    try:
        peft_model, _ = lora_exports.split(spec, state_dict, info.dtype,
                                           f"checkpoint {source.path}")
    except lora_exports.GatherMismatch as err:
        raise spec_error(str(err), path=("model", "lora"),
                         hint="export with the spec the checkpoint was trained with (`--spec "
                              "RUN_DIR/resolved.yaml`), or another checkpoint") from None
    adapter_out = out / lora_exports.EXPORT_ADAPTER_DIR if merged else out
    # the adapter first (merging unloads the adapters from the model), staged beside `out` when the
    # merged model goes there too: writing `out` replaces the directory whole
    staged = out.parent / f".{out.name}.adapter-{os.getpid()}" if merged else out
    adapter_record = None
    try:
        if adapter:
            named = {"name": adapter_out.name, "step": info.step, "dtype": info.dtype,
                     "source": info.source}
            adapter_record = lora_exports.write_adapter_dir(staged, spec, peft_model, named,
                                                            tokenizer=tokenizer, final=adapter_out)
        if not merged:
            assert adapter_record is not None, "export.adapter: merged, adapter or both"
            return adapter_record
        record = write_model_dir(out, spec, lora_exports.merged_state_dict(peft_model), info,
                                 tokenizer=tokenizer, show_progress=show_progress,
                                 label_names=read_label_names(source.path))
        if adapter_record is not None:
            os.replace(staged, adapter_out)
            adapter_record["path"] = str(adapter_out)
    except OSError as err:
        raise ExportFailed(describe_io_error(adapter_out, err)) from None
    finally:
        if merged:
            shutil.rmtree(staged, ignore_errors=True)   # gone once moved in; a failure's leftovers
    return {**record, "adapter": adapter_record}


def consolidated_state_dict(tag_dir: Path, client: dict, precision: str, dtype: str) -> tuple[dict,
                                                                                              list]:
    """Every weight of the checkpoint (lazy tensors where DeepSpeed gives them), and notes."""
    notes = []
    stage = _zero_stage(client)
    if not glob.glob(str(tag_dir / "*optim_states.pt")) or not stage:
        module = dict(client["module"])   # ZeRO-0: the whole module, as trained
        if dtype == "fp32" and precision != "fp32":
            notes.append("a ZeRO-0 checkpoint keeps the fp32 master weights only inside its "
                         f"optimizer state: saved from the {precision} weights")
        return module, notes
    from deepspeed.utils import zero_to_fp32
    try:
        # DeepSpeed prints its progress; stdout stays ours
        with contextlib.redirect_stdout(sys.stderr):
            if _bf16_optimizer_layout(tag_dir):
                state_dict = _bf16_optimizer_state_dict(zero_to_fp32, tag_dir)
            else:
                state_dict = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                    str(tag_dir.parent), tag=tag_dir.name, lazy_mode=True)
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as err:
        raise spec_error(f"DeepSpeed cannot merge the checkpoint {tag_dir}: "
                         f"{first_line(err, limit=300)}",
                         hint="check that every rank's *_optim_states.pt file is there, or export "
                              "another checkpoint") from None
    if stage <= 2:   # weights the optimizer does not own (frozen ones) are only in the module
        for name, tensor in client["module"].items():
            state_dict.setdefault(name, tensor)
    return state_dict, notes


def _bf16_optimizer_layout(tag_dir: Path) -> bool:
    """DeepSpeed's BF16_Optimizer (ZeRO-1, bf16, fp32 gradient accumulation) saves its fp32
    partitions without the `zero_stage` key that zero_to_fp32 looks for."""
    import torch
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE
    files = sorted(glob.glob(str(tag_dir / "bf16_zero_pp_rank_*_optim_states.pt")))
    if not files:
        return False
    optimizer = torch.load(files[0], map_location="cpu", mmap=True,
                           weights_only=False)[OPTIMIZER_STATE_DICT]
    return ZERO_STAGE not in optimizer


def _bf16_optimizer_state_dict(zero_to_fp32, tag_dir: Path) -> dict:
    """Its partitions are laid out as ZeRO-1/2's (parameters flattened in order, padded at the end
    to 2 x world size, split evenly): DeepSpeed's ZeRO-2 merge reads them once they are in hand."""
    import torch
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, SINGLE_PARTITION_OF_FP32_GROUPS
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(tag_dir)))
    files = zero_to_fp32.get_optim_files(str(tag_dir))
    groups = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)[OPTIMIZER_STATE_DICT]
              [SINGLE_PARTITION_OF_FP32_GROUPS] for f in files]
    return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(len(files), groups,
                                                                   model_states, False)


def _zero_stage(client: dict) -> int:
    """The ZeRO stage: jobspec's client state, else the DeepSpeed config saved with the
    checkpoint."""
    if client.get("zero_stage") is not None:
        return int(client["zero_stage"])
    return int(((client.get("ds_config") or {}).get("zero_optimization") or {}).get("stage") or 0)


def _model_states(tag_dir: Path) -> dict:
    import torch
    path = next(tag_dir / name for name in MODEL_STATES if (tag_dir / name).is_file())
    try:   # memory-mapped: a ZeRO-0 module is read tensor by tensor as it is converted
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 -- a truncated or foreign file: say which
        raise spec_error(f"cannot read {path}: {type(err).__name__}: {first_line(err, limit=200)}",
                         hint="the checkpoint is damaged: export an older one") from None


def _has_model_states(path: Path) -> bool:
    return any((path / name).is_file() for name in MODEL_STATES)


def _read_spec(path: Path) -> JobSpec:
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise spec_error(f"cannot read the job spec {path}: {err}",
                         hint="pass the run's resolved.yaml with --spec") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict) \
            or "memory" not in spec:
        raise spec_error(f"{path} is not a resolved job spec (resolved.yaml of a run directory)",
                         hint="pass RUN_DIR/resolved.yaml with --spec; `jobspec compile --out DIR` "
                              "writes one")
    from jobspec.spec.schema import filled_spec
    return filled_spec(spec)   # a spec of an older jobspec lacks the newer sections


def _spec_of_checkpoint(load_dir: Path, tag: str) -> JobSpec:
    copy = load_dir / tag / CHECKPOINT_SPEC
    if copy.is_file():
        return _read_spec(copy)
    for run_dir in _candidate_run_dirs(load_dir):
        return _read_spec(run_dir / rundir.RESOLVED)
    raise spec_error(f"cannot find the job spec of checkpoint {load_dir / tag}",
                     hint="pass the resolved.yaml of a run directory of that job with --spec")


def _candidate_run_dirs(load_dir: Path) -> list[Path]:
    """Run directories next to the checkpoint directory (the default layout) that trained into it,
    newest first."""
    found = []
    for run_dir in rundir.run_dirs(load_dir.parent, newest_first=True):
        try:
            spec = rundir.read_resolved(run_dir)
            if Path(spec["checkpoint"]["dir"]).resolve() == load_dir.resolve():
                found.append(run_dir)
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            continue
    return found


def _run_dirs(spec: JobSpec, load_dir: Path) -> list[Path]:
    output_dir = Path(spec["output_dir"] or load_dir.parent)
    return _candidate_run_dirs(load_dir) or [d
                                             for d in rundir.run_dirs(output_dir, newest_first=True)
                                             if (d / rundir.RESOLVED).is_file()]


def _world_size(client: dict, run_dir: Path | None) -> int | None:
    """The ranks that saved the checkpoint (its client state), else the run's derived job
    (launch.json)."""
    if client.get("world_size"):
        return int(client["world_size"])
    try:
        return int(rundir.read_launch(run_dir)["derived"]["world_size"]) if run_dir is not None \
            else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _metrics_at(run_dir: Path | None, step: int | None) -> dict:
    """The last train loss and eval metrics logged at or before `step` in the run's metrics.jsonl
    (empty if unknown)."""
    if run_dir is None or step is None or not (run_dir / rundir.METRICS).is_file():
        return {}
    found = {}
    for key, value, _timestamp, point_step in rundir.read_metric_points(run_dir):
        if (key == "train/loss" or key.startswith("eval/")) and point_step <= step:
            found[key] = value
    return found


OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def hub_offline():
    """No Hugging Face Hub access while `jobspec export` converts: the tokenizer and a hub model's
    config come from local files or the cache, or fail at once instead of waiting on the network.
    The env covers what is imported inside; huggingface_hub reads it once, at import, so its flag is
    set too. Both are restored after (`jobspec export` may run inside another process)."""
    import os

    import huggingface_hub.constants as hub  # light: no torch
    saved_env = {key: os.environ.get(key) for key in OFFLINE_ENV}
    saved_flag = hub.HF_HUB_OFFLINE
    os.environ.update(dict.fromkeys(OFFLINE_ENV, "1"))
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        hub.HF_HUB_OFFLINE = saved_flag
