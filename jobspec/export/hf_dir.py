"""A Hugging Face model directory from a state dict: what the worker's export and `jobspec export`
write.

    <out>/config.json             the model's config (the spec's architecture or checkpoint, and
                                  overrides; id2label/label2id: the training data's label names,
                                  when it had names)
    <out>/model*.safetensors      the weights in the chosen dtype (sharded with an index when large)
    <out>/generation_config.json  a model that generates: `eos_token_id` the tokenizer's EOS and
                                  the chat template's end-of-turn token, so `generate` stops at
                                  the end of a turn
    <out>/tokenizer files         when the job has a tokenizer (`data.tokenizer`, or the model's
                                  own; the job's `data.chat_template` as its chat template)
    <out>/README.md               model card: how it was trained, the metrics, the job spec
                                  (secrets masked)
    <out>/jobspec_export.json     what was exported: step, dtype, source, metrics

The weights go into the spec's model built on the meta device (`build_skeleton`): its state-dict
keys are the check that the weights belong to this spec, and transformers' own `save_pretrained`
writes them (tied weights, shard index, `dtype` in config.json), so
`AutoModelFor<task>.from_pretrained` reads the directory back. jobspec's own `mlp` is not a
transformers model: its directory holds config.json and model.safetensors only.

The directory is built next to `out` under a temporary name and renamed into place: a failed
write (full disk) leaves neither a half-written model nor a missing previous one.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from jobspec.errors import RunFailure, first_line, spec_error
from jobspec.spec.types import JobSpec

EXPORT_RECORD = "jobspec_export.json"
DTYPES = ("fp32", "bf16", "fp16")
# test hook: `[NAME:]ERRNO` (e.g. final:ENOSPC) raises that OSError while the weights of export NAME
# (of every export without NAME) are written, as a full disk would
INJECT_ERROR_ENV = "JOBSPEC_INJECT_EXPORT_ERROR"
# torch.compile's wrapper prefixes every key with it
_ORIG_MOD = "_orig_mod."


class ExportFailed(RunFailure):
    """Writing a model directory failed (disk full, permissions): one line, the checkpoints are
    intact."""


def torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass
class ExportInfo:
    """What the model card and jobspec_export.json say about an export."""

    # final | best | step<N> | a directory name given to `jobspec export`
    name: str
    step: int | None
    dtype: str
    source: str                    # "training run (rank 0)" or the checkpoint it was converted from
    metrics: dict
    notes: list
    world_size: int | None = None  # the ranks that trained it (the derived job's); None: unknown


def job_tokenizer(spec: JobSpec):
    """(tokenizer or None, note or None): the job's `data.tokenizer`, else the model checkpoint's
    own one."""
    from jobspec.model.build import build_tokenizer
    if spec["data"]["synthetic"] is None:
        return build_tokenizer(spec), None   # file data: the tokenizer that made the batches
    name = spec["data"]["tokenizer"] or spec["model"]["name_or_path"]
    if not name:
        return None, None   # an architecture trained on synthetic tokens has no tokenizer
    try:
        return build_tokenizer({**spec, "data": {**spec["data"], "synthetic": None,
                                                 "tokenizer": name}}), None
    except Exception as err:  # noqa: BLE001 -- a model without tokenizer files still exports
        return None, f"no tokenizer saved: {first_line(err, limit=200)}"


def write_model_dir(out: str | os.PathLike, spec: JobSpec, state_dict: dict, info: ExportInfo, *,
                    tokenizer=None,
                    show_progress: bool = False, label_names: dict | None = None) -> dict:
    """Write the directory `out` (replacing one that exists); returns its record (path, bytes, ...).

    `label_names`: the training data's string labels -> class ids (jobspec.data.loaders), written as
    the config's label2id/id2label so that `pipeline(...)` answers "positive", not "LABEL_1".

    `state_dict` values may be tensors or DeepSpeed's lazy `GatheredTensor`s; they are materialised
    and cast one at a time and the dict is consumed (its entries are replaced by the cast tensors).
    Raises ExportFailed for I/O errors, SpecError when the weights do not fit the spec's model.
    """
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    started = time.monotonic()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        model = _filled_skeleton(spec, state_dict, info.dtype, tokenizer, show_progress)
        stop_at_end_of_turn(model, spec, tokenizer)
        name_labels(model.config, label_names)
        _inject_error(tmp, info.name)
        _save_weights(model, tmp, spec)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        record = {"name": info.name, "step": info.step, "dtype": info.dtype, "source": info.source,
                  "metrics": info.metrics, "notes": info.notes, "job": spec["name"]}
        (tmp / "README.md").write_text(model_card(spec, info, model, tokenizer), encoding="utf-8")
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        follow_umask(tmp)
        _replace(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)   # a full disk gets its space back
        if _is_io_error(err):
            raise ExportFailed(describe_io_error(out, err)) from None
        raise
    return {**record, "path": str(out), "bytes": dir_bytes(out),
            "seconds": round(time.monotonic() - started, 3)}


def stop_at_end_of_turn(model, spec: JobSpec, tokenizer) -> None:
    """generation_config.json's `eos_token_id`: the tokenizer's EOS and the chat template's
    end-of-turn token (model/chat_turns.py), so `generate` and pipelines stop where a trained chat
    model ends its answer instead of writing the next turns; `pad_token_id` the tokenizer's. The
    job's own template file (`data.chat_template`) goes into the exported tokenizer, which then
    renders prompts as training did."""
    if tokenizer is None:
        return
    from jobspec.model.chat_turns import end_of_turn_ids

    template = with_job_template(spec, tokenizer)
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    ids = end_of_turn_ids(tokenizer, template)
    if ids:
        config.eos_token_id = ids[0] if len(ids) == 1 else ids
    if getattr(config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id


def with_job_template(spec: JobSpec, tokenizer) -> str | None:
    """The chat template the job rendered its records with, put into `tokenizer` when it is the
    job's own file (`data.chat_template`): the saved tokenizer renders prompts as training did."""
    from jobspec.data.chat_render import chat_template

    template = chat_template(spec, tokenizer)
    if template and spec["data"]["chat_template"]:
        tokenizer.chat_template = template
    return template


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc; else set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(directory: Path) -> None:
    """Every file under `directory` gets the mode a plain `open` gives it (0666 less the umask):
    safetensors and the hub's writers make theirs through private temporary files (0600)."""
    mode = 0o666 & ~umask()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def label_maps(label_names: dict | None, num_labels: int) -> tuple[dict, dict] | None:
    """(id2label, label2id) for a head of `num_labels` classes from the data's names -> ids; None
    without names. Every class gets an entry (an id the data never used keeps `LABEL_<id>`):
    transformers takes the length of id2label for the number of labels."""
    if not label_names:
        return None
    id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
    id2label.update({int(i): str(name) for name, i in label_names.items()
                     if 0 <= int(i) < num_labels})
    return id2label, {name: i for i, name in id2label.items()}


def name_labels(config, label_names: dict | None) -> None:
    """Put the label names on a transformers config (jobspec's own mlp has no label maps)."""
    num_labels = getattr(config, "num_labels", None)
    maps = label_maps(label_names, num_labels) if isinstance(num_labels, int) \
        and hasattr(config, "id2label") else None
    if maps is not None:
        config.id2label, config.label2id = maps


def describe_io_error(out: Path, err: BaseException) -> str:
    reason = err.strerror if isinstance(err, OSError) and err.strerror else first_line(err)
    culprit = getattr(err, "filename", None)
    if isinstance(err, (FileExistsError, NotADirectoryError)) and culprit \
            and not Path(culprit).is_dir():
        # mkdir(parents=True) says only "File exists"
        reason = f"{culprit} is a file, not a directory"
    return f"cannot write the model directory {out}: {reason}"


def _is_io_error(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return True
    # safetensors reports a failed write as its own error type, e.g. "I/O error: No space left on
    # device"
    return type(err).__name__ == "SafetensorError" and "I/O error" in str(err)


def _filled_skeleton(spec: JobSpec, state_dict: dict, dtype: str, tokenizer, show_progress: bool):
    from jobspec.model.build import build_skeleton

    model = build_skeleton(spec, tokenizer)
    target = torch_dtype(dtype)
    expected = set(model.state_dict().keys())
    converted: dict = {}   # id of a source tensor -> its cast copy: tied weights stay one tensor
    keys = list(state_dict)
    bar = _progress(len(keys), show_progress)
    for key in keys:
        value = state_dict.pop(key)
        name = key[len(_ORIG_MOD):] if key.startswith(_ORIG_MOD) else key
        if name not in expected:
            state_dict[name] = value   # kept for the mismatch report below
            bar.update(1)
            continue
        if id(value) not in converted:
            tensor = value.contiguous()   # a GatheredTensor is assembled from the rank shards here
            converted[id(value)] = tensor.to(target) if tensor.is_floating_point() else tensor
        state_dict[name] = converted[id(value)]
        bar.update(1)
    bar.close()
    _check_keys(spec, expected, set(state_dict))
    model.load_state_dict(state_dict, strict=True, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    state_dict.clear()
    return model


def _check_keys(spec: JobSpec, expected: set, found: set) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if not (missing or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    raise spec_error(f"the saved weights do not fit the model of job {spec['name']!r}: "
                     + "; ".join(parts),
                     path=("model",), hint="export with the spec the checkpoint was trained with "
                                            "(`jobspec export --spec RUN_DIR/resolved.yaml`)")


def _save_weights(model, directory: Path, spec: JobSpec) -> None:
    shard = spec["export"]["max_shard_size"]
    if hasattr(model, "save_pretrained"):
        from transformers.utils import logging as hf_logging
        shown = hf_logging.is_progress_bar_enabled()
        # a "Writing model shards" bar per export: the launch says it in a line
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(directory, max_shard_size=shard)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
        return
    from safetensors.torch import save_model  # jobspec's mlp: plain safetensors, config as a dict
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n",
                                           encoding="utf-8")
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _inject_error(directory: Path, export_name: str) -> None:
    import errno
    target, _, code_name = os.environ.get(INJECT_ERROR_ENV, "").rpartition(":")
    if code_name and target in ("", export_name):
        code = getattr(errno, code_name, errno.EIO)
        (directory / "model.safetensors").write_bytes(b"\0" * 1024)   # the part a full disk took
        raise OSError(code, os.strerror(code), str(directory / "model.safetensors"))


def _replace(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`; a previous `out` is moved aside first and removed only afterwards."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _progress(total: int, show: bool):
    class _Null:
        def update(self, n):
            pass

        def close(self):
            pass
    if not show or not sys.stderr.isatty():   # a terminal's: a pipe or a log gets the closing line
        return _Null()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="jobspec: converting weights", unit="tensor", file=sys.stderr,
                dynamic_ncols=True)


# --- the model card -------------------------------------------------------------------------------

def model_card(spec: JobSpec, info: ExportInfo, model, tokenizer) -> str:
    from jobspec import __version__
    from jobspec.model.build import TASK_MODEL_CLASSES
    from jobspec.secrets import mask_secrets

    model_spec, memory = spec["model"], spec["memory"]
    hf = hasattr(model, "save_pretrained")
    auto_class = TASK_MODEL_CLASSES.get(model_spec["task"], "AutoModel")
    ranks = f", {info.world_size} rank(s)" if info.world_size else ""
    base = model_spec["name_or_path"] \
        or f"a fresh `{model_spec['architecture']}` (random initialisation)"
    lines = ["---", f"library_name: {'transformers' if hf else 'jobspec'}", "tags:", "- jobspec",
             "- deepspeed", "---", "", f"# {spec['name']}", ""]
    if spec["description"]:
        lines += [spec["description"], ""]
    lines += [f"Trained with jobspec {__version__} from {base}: task `{model_spec['task']}`, "
              f"{memory['precision']} training, ZeRO stage {memory['zero_stage']}{ranks}. "
              f"Exported ({info.name}) at optimizer step "
              f"{info.step if info.step is not None else 'unknown'} in {info.dtype} from "
              f"{info.source}.", ""]
    lines += ["## Metrics", ""]
    if info.metrics:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in info.metrics.items()]
    else:
        lines.append("No metrics were recorded for this step.")
    lines += [""]
    if info.notes:
        lines += ["## Notes", "", *[f"- {note}" for note in info.notes], ""]
    lines += ["## Use", "", "```python"]
    if hf:
        lines += [f"from transformers import {auto_class}", "",
                  f'model = {auto_class}.from_pretrained("PATH")']
        if tokenizer is not None:
            lines += ["from transformers import AutoTokenizer",
                      'tokenizer = AutoTokenizer.from_pretrained("PATH")']
    else:
        lines += ["from safetensors.torch import load_model",
                  "from jobspec.model.mlp import MLPClassifier, MLPConfig",
                  "", "import json",
                  'model = MLPClassifier(MLPConfig(**json.load(open("PATH/config.json"))))',
                  'load_model(model, "PATH/model.safetensors")']
    spec_text = yaml.safe_dump(_masked(spec, mask_secrets), sort_keys=False)
    lines += ["```", "", "## Job spec", "",
              "The resolved spec (every default filled in; credentials masked):", "",
              "```yaml", spec_text.rstrip(), "```", ""]
    return "\n".join(lines)


def _masked(value, mask):
    """`value` with every string masked: the YAML stays valid (`'***'`, not an alias `***`)."""
    if isinstance(value, dict):
        return {k: _masked(v, mask) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v, mask) for v in value]
    return mask(value) if isinstance(value, str) else value


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
