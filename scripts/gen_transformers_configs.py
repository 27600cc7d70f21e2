"""Generate schemas/transformers-configs/: what `jobspec validate` knows of every transformers model type.

    python scripts/gen_transformers_configs.py                     # rewrite the shipped table (all types)
    python scripts/gen_transformers_configs.py --out DIR           # write it elsewhere (the staleness test)
    python scripts/gen_transformers_configs.py --only qwen2 gemma2 # these types only (with --out)
    python scripts/gen_transformers_configs.py --configs-only      # no model is built (fast: ~10 s)

One JSON file per model type the installed transformers registers (CONFIG_MAPPING), plus jobspec's
own `mlp`, and index.json (the common keywords, the list of types): `jobspec validate` reads the
index and the job's one file, never the others, and imports no transformers (jobspec/spec/freeform.py).

Per model type:
- `fields`, `aliases`: `model.config`'s keys. transformers 5 config classes are dataclasses that take
  any keyword: an unknown one becomes a stray attribute, so this is the only thing that catches a
  typo. The class's dataclass fields (JSON types from the annotations, enums from Literal/Enum
  annotations), its `attribute_map` aliases (`hidden_size` for GPT-2's `n_embd`), the legacy RoPE
  keywords transformers folds into `rope_parameters` (jobspec/job/model_config.py). Types are JSON
  Schema type names plus "float": a Python `float` annotation, which transformers' strict dataclasses
  refuse an int for (`initializer_range: 1` fails, `1.0` passes).
- `defaults`: the config's scalar values as the class builds them (pad_token_id, vocab_size,
  max_position_embeddings, ...): the rules that compare two keys read them where the spec is silent.
- `heads`: per jobspec task the model type has a head for (tasks/: its auto class), the head class,
  the attention implementations it supports, its output module and the modules LoRA can adapt, from
  a build of the model on the meta device with the default config (no weights: ~0.1 s a model),
  layer numbers written `*` (`model.layers.*.self_attn.q_proj`). A head that does not build from its
  default config has `error` instead: validate leaves its LoRA targets to --dry-run.
- `positions`: `rotary` (a rotary embedding module, or a rope config), `learned` (a position
  embedding table), or null.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "schemas" / "transformers-configs"
sys.path.insert(0, str(ROOT))

from jobspec.job.model_config import common_fields, dataclass_fields, transformers_entry  # noqa: E402

INDEX = "index.json"
BUILD_SECONDS = 120   # a model type whose meta build takes longer is recorded as an error, not waited for
MLP = "mlp"


def model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return sorted(CONFIG_MAPPING.keys())


def defaults(model_type: str, fields: dict) -> dict:
    """The config's JSON-scalar values as the class builds them by default (post-init included), for
    the keys of `fields` (the class's and the common ones)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        values = CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # noqa: BLE001 - a class that needs arguments: no defaults recorded
        return {}
    scalar = (bool, int, float, str, type(None))
    return {key: value for key, value in sorted(values.items())
            if key in fields and not key.startswith("_")
            and key not in ("transformers_version", "architectures", "dtype")
            and (isinstance(value, scalar) or (key.endswith("_token_id") and isinstance(value, list)
                                               and all(isinstance(v, int) for v in value)))
            and not (isinstance(value, float) and value != value)}


def pattern(name: str) -> str:
    """A module name with its layer numbers as `*`: one entry per distinct module of a layer stack."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def module_table(model) -> tuple[dict, str | None]:
    """{pattern: class name} of the modules LoRA can adapt, and the output module's pattern."""
    from jobspec.model.lora import ADAPTABLE

    modules = {pattern(name): type(module).__name__ for name, module in model.named_modules()
               if name and type(module).__name__ in ADAPTABLE}
    get = getattr(model, "get_output_embeddings", None)
    try:
        output = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - heads without one raise NotImplementedError or AttributeError
        output = None
    name = next((n for n, m in model.named_modules() if m is output), None) if output is not None else None
    return dict(sorted(modules.items())), pattern(name) if name else None


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def heads(model_type: str) -> tuple[dict, str | None]:
    """Per task: the head class, attention support, output module and adaptable modules; and `positions`."""
    import torch
    import transformers

    from jobspec import tasks

    out: dict = {}
    positions = None
    for task_name, task in sorted(tasks.TASKS.items()):
        auto = getattr(transformers, task.auto_class)
        class_name = auto._model_mapping._model_mapping.get(model_type)
        if class_name is None:
            continue
        entry: dict = {"class": class_name}
        try:
            cls = getattr(transformers, class_name)
            entry["attention"] = {"sdpa": bool(getattr(cls, "_supports_sdpa", False)),
                                  "flash_attention_2": bool(getattr(cls, "_supports_flash_attn", False)),
                                  "eager": True}
            signal.alarm(BUILD_SECONDS)
            try:
                with torch.device("meta"):
                    model = auto.from_config(transformers.AutoConfig.for_model(model_type))
            finally:
                signal.alarm(0)
            entry["modules"], entry["output"] = module_table(model)
            names = [n for n, _ in model.named_modules()]
            if positions is None:
                positions = _positions(model, names)
            del model
        except _Timeout:
            entry["error"] = f"no meta build within {BUILD_SECONDS} s"
        except BaseException as err:  # noqa: BLE001 - whatever a default config's build raises
            if isinstance(err, KeyboardInterrupt):
                raise
            entry["error"] = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        out[task_name] = entry
    return out, positions


def _positions(model, names: list[str]) -> str | None:
    config = model.config
    if any("rotary" in n.rsplit(".", 1)[-1] or n.endswith("rotary_emb") for n in names) \
            or getattr(config, "rope_parameters", None):
        return "rotary"
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    if any(kinds[n] == "Embedding" and re.search(r"(position|wpe|pos_emb)", n.rsplit(".", 1)[-1]) for n in names):
        return "learned"
    return None


def mlp_file(with_modules: bool) -> dict:
    from jobspec.model.mlp import CONFIG_KEYS, MLPConfig

    fields = dataclass_fields(MLPConfig)
    entry: dict = {"model_type": MLP, "class": "jobspec.model.mlp.MLPConfig", "common": False,
                   "fields": {name: fields[name] for name in CONFIG_KEYS}, "aliases": {},
                   "defaults": {name: getattr(MLPConfig(), name) for name in CONFIG_KEYS}, "positions": None}
    if with_modules:
        import torch

        from jobspec.model.mlp import build_mlp
        spec = {"model": {"task": "sequence-classification", "config": {}, "num_labels": 2},
                "training": {"seed": 0}}
        with torch.device("meta"):
            model = build_mlp(spec)
        modules, output = module_table(model)
        entry["heads"] = {"sequence-classification": {"class": "MLPClassifier", "modules": modules, "output": output,
                                                      "attention": {"sdpa": True, "flash_attention_2": False,
                                                                    "eager": True}}}
    return entry


def type_file(model_type: str, common: dict, with_modules: bool) -> dict:
    entry = transformers_entry(model_type, common)
    fields = {**common, **entry["fields"]}
    out = {"model_type": model_type, **entry, "defaults": defaults(model_type, fields)}
    if with_modules:
        out["heads"], out["positions"] = heads(model_type)
    return out


def build(only: list[str] | None = None, with_modules: bool = True, log=None) -> dict[str, dict]:
    """{file name: content}; index.json always lists every type."""
    import transformers

    common = common_fields()
    every = model_types() + [MLP]
    files = {INDEX: {
        "generated_by": "scripts/gen_transformers_configs.py",
        "transformers_version": transformers.__version__,
        "types": "JSON Schema type names; float: a Python float annotation (an integer is refused)",
        "common": common,
        "model_types": sorted(every),
    }}
    signal.signal(signal.SIGALRM, _alarm)
    for model_type in (only or every):
        started = time.perf_counter()
        files[f"{model_type}.json"] = (mlp_file(with_modules) if model_type == MLP
                                       else type_file(model_type, common, with_modules))
        if log:
            log(f"{model_type}: {time.perf_counter() - started:.2f} s")
    return files


def render(content: dict) -> str:
    return json.dumps(content, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="write these types' files only")
    parser.add_argument("--configs-only", action="store_true", help="leave out `heads` (no model is built)")
    parser.add_argument("--verbose", action="store_true", help="print each type's generation time")
    args = parser.parse_args(argv)
    import logging
    import warnings

    import transformers
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    files = build(args.only, with_modules=not args.configs_only,
                  log=(lambda line: print(line, flush=True)) if args.verbose else None)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only is None and args.out == DEFAULT_OUT:   # a type transformers dropped leaves no file behind
        for stale in args.out.glob("*.json"):
            if stale.name not in files:
                stale.unlink()
    for name, content in files.items():
        (args.out / name).write_text(render(content), encoding="utf-8")
    print(f"wrote {len(files)} files to {args.out} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
