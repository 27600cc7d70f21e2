"""The model's dimensions (hidden size, layers, heads, vocabulary, positions) without importing
transformers.

`jobspec validate` and `jobspec compile` need a few numbers before any model exists: the compiler
sizes ZeRO buckets from the hidden size, validation checks `every_n_layers` against the layer count.
They come from, lowest priority first:

1. `ARCHITECTURE_DEFAULTS`: the defaults of transformers' `configuration_<model>.py` classes
   (copied from transformers 5.x source; the values have been stable across 4.x),
2. a local checkpoint's `config.json` (read by the caller with `read_local_config`),
3. the spec's `model.config`.

Unknown architectures still work when the config names a hidden size; otherwise `model_dims`
returns None and the compiler writes DeepSpeed's own defaults. Parameters, activations and FLOPs are
not computed here: the planner measures them from the model itself (jobspec/model/planner_trace.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jobspec.spec.types import JobSpec

# transformers' config defaults per model_type, under the canonical names below.
ARCHITECTURE_DEFAULTS: dict[str, dict] = {
    "bert": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072,
                 vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
                 tie_word_embeddings=True),
    "roberta": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072,
                    vocab_size=50265, max_position_embeddings=512, type_vocab_size=2,
                    tie_word_embeddings=True, pad_token_id=1),
    # XLMRobertaConfig's defaults are BERT's (vocab 30522), not the released checkpoints' 250002.
    "xlm-roberta": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072,
                        vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
                        tie_word_embeddings=True, pad_token_id=1),
    # n_inner None means 4 * n_embd.
    "gpt2": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=None,
                 vocab_size=50257, max_position_embeddings=1024, tie_word_embeddings=True),
    "llama": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=None,
                  intermediate_size=11008, vocab_size=32000, max_position_embeddings=2048,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "mistral": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=32000, max_position_embeddings=4096 * 32,
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "distilbert": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                       intermediate_size=4 * 768,
                       vocab_size=30522, max_position_embeddings=512, tie_word_embeddings=True),
    "deberta-v2": dict(hidden_size=1536, num_hidden_layers=24, num_attention_heads=24,
                       intermediate_size=6144,
                       vocab_size=128100, max_position_embeddings=512, type_vocab_size=0,
                       tie_word_embeddings=True, relative_attention=False,
                       position_biased_input=True),
    # jobspec's own deep MLP (jobspec/model/mlp.py: MLPConfig's defaults); no attention, no
    # positions.
    "mlp": dict(hidden_size=1024, num_hidden_layers=16, vocab_size=30522, max_position_embeddings=0,
                tie_word_embeddings=False),
}

# Family-specific config keys -> the canonical names above (transformers' `attribute_map`s).
_ALIASES: dict[str, str] = {
    "n_embd": "hidden_size", "dim": "hidden_size", "d_model": "hidden_size",
    "n_layer": "num_hidden_layers", "n_layers": "num_hidden_layers",
    "num_layers": "num_hidden_layers",
    "n_head": "num_attention_heads", "n_heads": "num_attention_heads",
    "n_inner": "intermediate_size", "hidden_dim": "intermediate_size",
    "ffn_dim": "intermediate_size", "n_positions": "max_position_embeddings",
}


# Families whose positions are a learned table (an index past its end is an error in the ranks), and
# the ids their first position takes: RoBERTa-style models start after the padding index (2 with
# their default pad id 1).
LEARNED_POSITIONS: dict[str, int] = {"bert": 0, "roberta": 2, "xlm-roberta": 2, "camembert": 2,
                                     "gpt2": 0,
                                     "distilbert": 0, "electra": 0, "albert": 0, "gpt_neo": 0}
# RoBERTa's position ids count from `pad_token_id + 1` (transformers'
# create_position_ids_from_input_ids: padding keeps position `pad_token_id`), so
# `max_position_embeddings: 514` holds 512 tokens with pad id 1.
PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


@dataclass(frozen=True)
class ModelDims:
    model_type: str | None
    hidden_size: int
    num_layers: int | None = None
    num_heads: int | None = None
    # None: as many as the attention heads (no grouped-query attention)
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    pad_token_id: int | None = None

    @property
    def usable_positions(self) -> int | None:
        """The longest sequence the model's learned position table takes; None where positions are
        not a table (rotary, relative) or the size is unknown."""
        if self.model_type not in LEARNED_POSITIONS or not self.max_position_embeddings:
            return None
        if self.model_type in PADDING_OFFSET_POSITIONS and self.pad_token_id is not None:
            return self.max_position_embeddings - (self.pad_token_id + 1)
        return self.max_position_embeddings - LEARNED_POSITIONS[self.model_type]


def _canonical(config: dict) -> dict:
    return {_ALIASES.get(k, k): v for k, v in config.items()}


def model_dims(spec: JobSpec, config_json: dict | None = None) -> ModelDims | None:
    """Dimensions of the spec's model: architecture defaults, then `config_json`, then
    `model.config`.

    `spec` is a resolved spec (or any dict with a `model` mapping); `config_json` is the parsed
    `config.json` of a local `model.name_or_path` directory, if there is one.
    """
    model = spec.get("model") or {}
    config_json = config_json or {}
    model_type = model.get("architecture") or config_json.get("model_type")
    values = dict(ARCHITECTURE_DEFAULTS.get(model_type, {})) if model_type is not None else {}
    values.update(_canonical(config_json))
    values.update(_canonical(model.get("config") or {}))
    hidden = _count(values.get("hidden_size"))
    if hidden is None:
        return None
    return ModelDims(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=_count(values.get("num_hidden_layers")),
        num_heads=_count(values.get("num_attention_heads")),
        num_key_value_heads=_count(values.get("num_key_value_heads")),
        intermediate_size=_count(values.get("intermediate_size"))
        or (4 * hidden if model_type == "gpt2" else None),
        vocab_size=_count(values.get("vocab_size")),
        max_position_embeddings=_count(values.get("max_position_embeddings"), minimum=0),
        pad_token_id=_count(values.get("pad_token_id"), minimum=0),
    )


def _count(value: object, minimum: int = 1) -> int | None:
    """A dimension as an int; anything else (a list, a string: reported by the model.config check)
    is unknown."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum \
        else None


def read_local_config(name_or_path: str | None) -> dict | None:
    """The parsed `config.json` of a local checkpoint directory, or None for hub ids and missing
    files."""
    if not name_or_path:
        return None
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        return None
    try:
        config: dict = json.loads(path.read_text(encoding="utf-8"))
        return config
    except (OSError, ValueError):
        return None
