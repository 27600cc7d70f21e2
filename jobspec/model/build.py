"""The spec's model and tokenizer: a hub id / local checkpoint, or an architecture with random
weights.

`build_model` picks the `AutoModelFor<task>` head from `model.task`, asks transformers for the
attention implementation in `model.attention`, and turns the usual loading failures (unknown
architecture, no network for a hub id, flash-attn missing) into `SpecError`s that say which field to
change.
"""
from __future__ import annotations

import sys

from jobspec import tasks
from jobspec.errors import SpecError, did_you_mean, first_line, spec_error
from jobspec.spec.types import JobSpec, JobSpecModel

# model.task -> the transformers auto class that puts the right head (and loss) on the model
# (jobspec/tasks)
TASK_MODEL_CLASSES: dict[str, str] = {name: task.auto_class for name, task in tasks.TASKS.items()}


def build_tokenizer(spec: JobSpec):
    """The tokenizer named by `data.tokenizer` (or `model.name_or_path`); None for synthetic
    data."""
    data, model = spec["data"], spec["model"]
    if data.get("synthetic") is not None:
        return None
    name = data.get("tokenizer") or model.get("name_or_path")
    if not name:
        raise spec_error("file data needs a tokenizer, and the model is built from an architecture",
                         path=("data", "tokenizer"),
                         hint="set data.tokenizer to a local tokenizer directory or a hub id")
    from transformers import AutoTokenizer

    same_as_model = name == model.get("name_or_path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=model.get("revision") if same_as_model else None,
            trust_remote_code=bool(model.get("trust_remote_code")))
    except (OSError, ValueError) as err:
        raise spec_error(f"cannot load tokenizer {name!r}: {first_line(err)}",
                         path=("data", "tokenizer") if data.get("tokenizer")
                         else ("model", "name_or_path"),
                         hint="give a local directory with tokenizer files, or a hub id reachable "
                              "from here")
    if tokenizer.pad_token is None:
        # GPT-style tokenizers ship without a pad token; padding with EOS is the usual choice and
        # the attention mask (and -100 labels) keep the padding out of the loss.
        if tokenizer.eos_token is None:
            raise spec_error(f"tokenizer {name!r} has neither a pad nor an eos token to pad with",
                             path=("data", "tokenizer"), hint="use a tokenizer with a pad token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(spec: JobSpec, tokenizer=None, ds_config: dict | None = None):
    """`AutoModelFor<task>` from `model.name_or_path` (weights loaded) or `model.architecture`
    (random init).

    Random initialisation is seeded by `training.seed`, so every rank builds the same weights.
    Pass the tokenizer when there is one: its pad token becomes the model's (GPT-2 needs one to
    classify batches) and its size is checked against the model's vocabulary.
    `architecture: mlp` is jobspec's own deep MLP (jobspec/model/mlp.py), not a transformers model.
    The ranks pass their compiled DeepSpeed config: the model is then built in the training dtype,
    and under ZeRO-3 partitioned by `deepspeed.zero.Init` as it is built (model/construct.py).
    Without one (export, tools) it is built as transformers builds it by default.
    """
    from jobspec.model.construct import construction_for, set_transformers_zero3, zero_init

    construction = None if ds_config is None else construction_for(ds_config)
    if ds_config is not None and construction is not None and construction.zero3 and \
            spec["model"].get("quantization"):
        # bitsandbytes quantises whole weights after the build (_quantized): a partitioned
        # placeholder cannot be quantised, so a quantised base is built whole and DeepSpeed
        # partitions what it may
        construction = construction_for({**ds_config, "zero_optimization": {"stage": 0}})
    if spec["model"].get("architecture") == "mlp" and not spec["model"].get("name_or_path"):
        from jobspec.model.mlp import build_mlp

        if construction is None:
            model = build_mlp(spec)
        else:
            with zero_init(construction):
                model = build_mlp(spec)
        _check_vocab(spec, model, tokenizer)
        return model
    import torch

    if construction is not None:
        # transformers' zero.Init, or none left from an earlier build
        set_transformers_zero3(construction)
    dtype = {} if construction is None else {"dtype": construction.torch_dtype}

    model_spec = spec["model"]
    task = model_spec["task"]
    attention = model_spec["attention"]
    trust = bool(model_spec.get("trust_remote_code"))
    _warn_remote_code(model_spec)

    try:
        auto_class, config = build_config(spec, tokenizer)
        if model_spec.get("name_or_path"):
            name, revision = model_spec["name_or_path"], model_spec.get("revision")
            model = auto_class.from_pretrained(name, config=config, revision=revision,
                                               trust_remote_code=trust,
                                               attn_implementation=attention, **dtype)
        else:
            torch.manual_seed(spec["training"]["seed"])
            model = auto_class.from_config(config, attn_implementation=attention,
                                           trust_remote_code=trust, **dtype)
    except SpecError:
        raise
    except ImportError as err:
        raise spec_error(f"attention {attention!r} cannot be used here: {first_line(err)}",
                         path=("model", "attention"),
                         hint="install the package it names (flash-attn needs a CUDA GPU) or use "
                              "sdpa") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise loading_error(model_spec, task, attention, err) from None

    _check_vocab(spec, model, tokenizer)
    if model_spec.get("quantization"):
        model = _quantized(spec, model)
    return model


def _quantized(spec: JobSpec, model):
    """QLoRA's frozen base: the linear layers quantised by bitsandbytes on this rank's device
    (model/quantize.py), the rest in the compute dtype. bitsandbytes missing or unable to run here
    is a SpecError at model.quantization, never a rank's traceback."""
    import os

    import torch

    from jobspec.model.lora import compute_dtype, quantization_config, quantized_linear_names
    from jobspec.model.quantize import BITSANDBYTES_HINT, bitsandbytes_problem, quantize_linears

    quant = spec["model"]["quantization"]
    assert quant is not None, "quantize needs model.quantization"
    problem = bitsandbytes_problem(quant)
    if problem:
        raise spec_error(problem, path=("model", "quantization"), hint=BITSANDBYTES_HINT)
    bnb_config = quantization_config(spec, model)
    # the compute dtype (model.quantization.compute_dtype, `auto`: the training precision) for the
    # layers that stay unquantised too: DeepSpeed casts them to the training precision anyway
    compute = getattr(torch, compute_dtype(spec))
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if torch.cuda.is_available()
              else torch.device("cpu"))
    model = model.to(compute)
    quantize_linears(model, bnb_config, quantized_linear_names(spec, model), device)
    return model.to(device)


def build_config(spec: JobSpec, tokenizer=None):
    """(the `AutoModelFor<task>` class, the model's config) exactly as `build_model` makes them.

    Loading errors propagate as transformers raises them; `build_model` turns them into SpecErrors.
    """
    import transformers

    model_spec = spec["model"]
    task = model_spec["task"]
    auto_class = getattr(transformers, tasks.get(task).auto_class)
    overrides = dict(model_spec["config"])
    if tasks.get(task).classification:
        overrides.setdefault("num_labels", model_spec["num_labels"])
    name_or_path = model_spec["name_or_path"]
    if name_or_path:
        config = transformers.AutoConfig.from_pretrained(
            name_or_path, revision=model_spec["revision"],
            trust_remote_code=model_spec["trust_remote_code"], **overrides)
    else:
        for key, value in tokenizer_token_ids(spec, tokenizer).items():
            overrides.setdefault(key, value)   # what model.config writes wins
        config = _config_for_architecture(model_spec.get("architecture"), overrides)
    _set_pad_token(config, tokenizer)
    return auto_class, config


def tokenizer_token_ids(spec: JobSpec, tokenizer=None) -> dict[str, int | None]:
    """bos/eos/pad ids for a model built from an architecture: the tokenizer's (`build_tokenizer`'s
    object, else the local tokenizer directory read as JSON, so the planner's trace and export build
    the same config the ranks do); {} for synthetic data or a tokenizer only transformers reads.

    An architecture's defaults belong to its original tokenizer (GPT-2: 50256 for both bos and eos):
    against another tokenizer they are ids outside the vocabulary, or the wrong tokens, and
    transformers warns about them on every config it builds. A token the tokenizer lacks is None,
    not the default.
    """
    if tokenizer is not None:
        return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id}
    from jobspec.data.tokenizer_files import read_tokenizer, tokenizer_name

    name = tokenizer_name(spec)
    try:
        facts = read_tokenizer(name) if name else None
    # a broken file: validate said so; the ranks' tokenizer load refuses it
    except (ValueError, OSError):
        facts = None
    if facts is None:
        return {}
    return {"bos_token_id": facts.ids["bos"], "eos_token_id": facts.ids["eos"],
            "pad_token_id": facts.pad_id}


def build_skeleton(spec: JobSpec, tokenizer=None):
    """The spec's model on the meta device: its config, parameter names and shapes, no weights.

    What an export fills with saved weights (`load_state_dict(assign=True)`): nothing is read from a
    checkpoint's weight files and no memory is spent on a random initialisation. Never partitioned,
    even in a rank that trains under ZeRO-3 (rank 0 builds it alone to write an export).
    """
    import torch

    from jobspec.model.construct import without_transformers_zero3

    with without_transformers_zero3(), torch.device("meta"):
        if spec["model"].get("architecture") == "mlp" and not spec["model"].get("name_or_path"):
            from jobspec.model.mlp import build_mlp
            return build_mlp(spec)
        try:
            auto_class, config = build_config(spec, tokenizer)
            remote = bool(spec["model"].get("trust_remote_code"))
            return auto_class.from_config(config, trust_remote_code=remote)
        except SpecError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise loading_error(spec["model"], spec["model"]["task"],
                                 spec["model"]["attention"], err) from None


def _config_for_architecture(architecture: str | None, overrides: dict):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not architecture:
        raise spec_error("the model needs `name_or_path` or `architecture`", path=("model",),
                         hint="set model.architecture (e.g. bert) or model.name_or_path")
    if architecture not in CONFIG_MAPPING:
        raise spec_error(f"unknown architecture {architecture!r} for transformers' AutoConfig",
                         path=("model", "architecture"),
                         hint=did_you_mean(architecture, list(CONFIG_MAPPING), n=3, quote="",
                                           otherwise="use a model_type such as bert, gpt2"))
    try:
        return AutoConfig.for_model(architecture, **overrides)
    # TypeError, ValueError, huggingface_hub's strict-dataclass errors
    except Exception as err:  # noqa: BLE001
        raise spec_error(f"invalid config for {architecture}: {first_line(err)}",
                         path=("model", "config"),
                         hint="check the field names against the architecture's transformers "
                              "config") from None


def _set_pad_token(config, tokenizer) -> None:
    if getattr(config, "pad_token_id", None) is not None:
        return
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    elif getattr(config, "eos_token_id", None) is not None:
        # Decoder-only classifiers find each sample's last token by looking for the pad id;
        # synthetic data has no padding, so any id outside the data works and EOS is conventional.
        eos = config.eos_token_id
        config.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos


def _check_vocab(spec: JobSpec, model, tokenizer) -> None:
    vocab_size = getattr(model.config, "vocab_size", None)
    if not vocab_size:
        return
    synthetic = spec["data"]["synthetic"]
    if synthetic is not None:
        high = synthetic["vocab_range"][1]
        if high > vocab_size:
            raise spec_error(f"synthetic token ids go up to {high - 1} but the model's vocabulary "
                             f"has {vocab_size} entries", path=("data", "synthetic", "vocab_range"),
                             hint=f"set vocab_range to end at most at {vocab_size}, or raise "
                                  "model.config.vocab_size")
    elif tokenizer is not None and len(tokenizer) > vocab_size:
        raise spec_error(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                         f"only {vocab_size}", path=("model", "config", "vocab_size"),
                         hint=f"set model.config.vocab_size to at least {len(tokenizer)}")


def loading_error(model_spec: JobSpecModel, task: str, attention: str, err: Exception) -> SpecError:
    text = first_line(err)
    if "attn" in text.lower() or "attention" in text.lower():
        text = text.split(". ")[0]   # transformers goes on with a paragraph of advice
        return spec_error(f"attention {attention!r} is not supported by this model: {text}",
                          path=("model", "attention"),
                          hint="use eager" if attention != "eager" else "use sdpa",
                          code="model-build")
    if model_spec.get("name_or_path"):
        return spec_error(f"cannot load {model_spec['name_or_path']!r} for {task}: {text}",
                          path=("model", "name_or_path"),
                          hint="give a local checkpoint directory, or a hub id reachable from "
                               "here", code="model-build")
    from jobspec.spec import model_table

    architecture = model_spec.get("architecture")
    if model_table.head(architecture, task):   # the type has this head: its config is what failed
        written = [str(key) for key in model_spec["config"]]
        named = [key for key in written if key in text] \
            or [key for key in written if _mentions(text, key)]
        return spec_error(f"transformers cannot build {architecture!r} from this model.config: "
                          f"{text}",
                          path=("model", "config", named[0]) if named else ("model", "config"),
                          hint=f"change {', '.join(named)} (the values transformers names)"
                          if named else
                          "change the model.config values transformers names", code="model-build")
    return spec_error(f"cannot build {architecture!r} for {task}: {text}",
                      path=("model", "task"), hint="pick a task this architecture has a head for",
                      code="model-build")


def _mentions(text: str, key: str) -> bool:
    """Whether transformers' message names `key` by another of its usual spellings (GPT-2's `n_head`
    as `num_heads`, `n_embd` as `embed_dim`)."""
    spellings = {"n_head": ("num_heads", "num_attention_heads"),
                 "n_embd": ("embed_dim", "hidden_size"),
                 "hidden_size": ("embed_dim",), "num_attention_heads": ("num_heads",),
                 "n_layer": ("num_layers",)}
    return any(word in text for word in spellings.get(key, ()))


def _warn_remote_code(model_spec: JobSpecModel) -> None:
    if model_spec.get("trust_remote_code"):
        print("WARNING: model.trust_remote_code is true: Python code from "
              f"{model_spec.get('name_or_path')!r} will run on this machine with your permissions. "
              "Only do this for repositories you trust.",
              file=sys.stderr, flush=True)
