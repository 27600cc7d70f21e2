"""The model's dimensions (hidden size, layers, heads, vocabulary, ...) without importing transformers.

The compiler sizes ZeRO buckets from the hidden size and the memory planner counts parameters, so
both need the numbers before any weights exist. They come from, lowest priority first:

1. `ARCHITECTURE_DEFAULTS`: the defaults of transformers' `configuration_<model>.py` classes
   (copied from transformers 5.x source; the values have been stable across 4.x),
2. a local checkpoint's `config.json` (read by the caller with `read_local_config`),
3. the spec's `model.config`.

Unknown architectures still work when the config names a hidden size; otherwise `model_dims`
returns None and the compiler writes DeepSpeed's own defaults.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# transformers' config defaults per model_type, under the canonical names below.
ARCHITECTURE_DEFAULTS: dict[str, dict] = {
    "bert": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, tie_word_embeddings=True),
    "roberta": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    vocab_size=50265, max_position_embeddings=512, type_vocab_size=2, tie_word_embeddings=True),
    # XLMRobertaConfig's defaults are BERT's (vocab 30522), not the released checkpoints' 250002.
    "xlm-roberta": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                        vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
                        tie_word_embeddings=True),
    # n_inner None means 4 * n_embd.
    "gpt2": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=None,
                 vocab_size=50257, max_position_embeddings=1024, tie_word_embeddings=True),
    "llama": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                  intermediate_size=11008, vocab_size=32000, max_position_embeddings=2048,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "mistral": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=32000, max_position_embeddings=4096 * 32,
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "distilbert": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=4 * 768,
                       vocab_size=30522, max_position_embeddings=512, tie_word_embeddings=True),
    "deberta-v2": dict(hidden_size=1536, num_hidden_layers=24, num_attention_heads=24, intermediate_size=6144,
                       vocab_size=128100, max_position_embeddings=512, type_vocab_size=0,
                       tie_word_embeddings=True, relative_attention=False, position_biased_input=True),
    # jobspec's own deep MLP (jobspec/model/mlp.py: MLPConfig's defaults); no attention, no positions.
    "mlp": dict(hidden_size=1024, num_hidden_layers=16, vocab_size=30522, max_position_embeddings=0,
                tie_word_embeddings=False),
}

# Family-specific config keys -> the canonical names above (transformers' `attribute_map`s).
_ALIASES: dict[str, str] = {
    "n_embd": "hidden_size", "dim": "hidden_size", "d_model": "hidden_size",
    "n_layer": "num_hidden_layers", "n_layers": "num_hidden_layers", "num_layers": "num_hidden_layers",
    "n_head": "num_attention_heads", "n_heads": "num_attention_heads",
    "n_inner": "intermediate_size", "hidden_dim": "intermediate_size", "ffn_dim": "intermediate_size",
    "n_positions": "max_position_embeddings",
}

_ENCODERS = {"bert", "roberta", "xlm-roberta", "deberta-v2"}
_DECODERS = {"llama", "mistral"}


@dataclass(frozen=True)
class ModelDims:
    model_type: str | None
    hidden_size: int
    num_layers: int | None = None
    num_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = True
    type_vocab_size: int = 0
    num_key_value_heads: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    relative_attention: bool = False
    position_biased_input: bool = True

    def num_parameters(self, task: str = "sequence-classification", num_labels: int = 2) -> int | None:
        """Trainable parameters of `AutoModelFor<task>.from_config(...)`, tied weights counted once.

        Exact for bert, roberta, xlm-roberta, gpt2, llama, mistral, distilbert and mlp; deberta-v2 counts
        everything but its relative-position tables. None when the family or a dimension is unknown.
        """
        if None in (self.num_layers, self.vocab_size, self.max_position_embeddings) or \
                self.model_type not in ARCHITECTURE_DEFAULTS:
            return None
        if self.model_type == "mlp":
            return _mlp(self, task, num_labels)
        ffn = self.intermediate_size or 4 * self.hidden_size
        if self.model_type == "gpt2":
            return _gpt2(self, ffn, task, num_labels)
        if self.model_type in _DECODERS:
            return _llama(self, ffn, task, num_labels)
        if self.model_type == "distilbert":
            return _distilbert(self, ffn, task, num_labels)
        return _encoder(self, ffn, task, num_labels)


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _mlp(d: ModelDims, task: str, num_labels: int) -> int | None:
    if task != "sequence-classification":
        return None   # jobspec.model.mlp has only a classification head
    h = d.hidden_size
    return d.vocab_size * h + d.num_layers * _linear(h, h) + _linear(h, num_labels)


def _encoder(d: ModelDims, ffn: int, task: str, num_labels: int) -> int:
    h = d.hidden_size
    positions = d.max_position_embeddings if d.position_biased_input else 0
    embeddings = (d.vocab_size + positions + d.type_vocab_size) * h + 2 * h
    layer = 4 * _linear(h, h) + _linear(h, ffn) + _linear(ffn, h) + 2 * (2 * h)  # attention, MLP, 2 LayerNorms
    body = embeddings + d.num_layers * layer
    lm_head = _linear(h, h) + 2 * h + d.vocab_size + (0 if d.tie_word_embeddings else d.vocab_size * h)
    if task == "sequence-classification":
        # BertPooler + classifier, RobertaClassificationHead (dense + out_proj) and DeBERTa's
        # ContextPooler + classifier all have the same size
        return body + _linear(h, h) + _linear(h, num_labels)
    if task == "token-classification":
        return body + _linear(h, num_labels)
    return body + lm_head  # masked-lm and causal-lm share the prediction head


def _gpt2(d: ModelDims, ffn: int, task: str, num_labels: int) -> int:
    h = d.hidden_size
    layer = 2 * h + _linear(h, 3 * h) + _linear(h, h) + 2 * h + _linear(h, ffn) + _linear(ffn, h)
    body = (d.vocab_size + d.max_position_embeddings) * h + d.num_layers * layer + 2 * h
    if task == "sequence-classification":
        return body + _linear(h, num_labels, bias=False)
    if task == "token-classification":
        return body + _linear(h, num_labels)
    return body + (0 if d.tie_word_embeddings else d.vocab_size * h)


def _llama(d: ModelDims, ffn: int, task: str, num_labels: int) -> int:
    h = d.hidden_size
    heads = d.num_heads or 1
    head_dim = h // heads
    kv = (d.num_key_value_heads or heads) * head_dim
    attention = _linear(h, h, d.attention_bias) + 2 * _linear(h, kv, d.attention_bias) + _linear(h, h, d.attention_bias)
    layer = attention + 2 * _linear(h, ffn, d.mlp_bias) + _linear(ffn, h, d.mlp_bias) + 2 * h  # 2 RMSNorms
    body = d.vocab_size * h + d.num_layers * layer + h
    if task == "sequence-classification":
        return body + _linear(h, num_labels, bias=False)
    if task == "token-classification":
        return body + _linear(h, num_labels)
    return body + (0 if d.tie_word_embeddings else d.vocab_size * h)


def _distilbert(d: ModelDims, ffn: int, task: str, num_labels: int) -> int:
    h = d.hidden_size
    layer = 4 * _linear(h, h) + _linear(h, ffn) + _linear(ffn, h) + 2 * (2 * h)
    body = (d.vocab_size + d.max_position_embeddings) * h + 2 * h + d.num_layers * layer
    if task == "sequence-classification":
        return body + _linear(h, h) + _linear(h, num_labels)  # pre_classifier + classifier
    if task == "token-classification":
        return body + _linear(h, num_labels)
    return body + _linear(h, h) + 2 * h + d.vocab_size + (0 if d.tie_word_embeddings else d.vocab_size * h)


def _canonical(config: dict) -> dict:
    return {_ALIASES.get(k, k): v for k, v in config.items()}


def model_dims(spec: dict, config_json: dict | None = None) -> ModelDims | None:
    """Dimensions of the spec's model: architecture defaults, then `config_json`, then `model.config`.

    `spec` is a resolved spec (or any dict with a `model` mapping); `config_json` is the parsed
    `config.json` of a local `model.name_or_path` directory, if there is one.
    """
    model = spec.get("model") or {}
    config_json = config_json or {}
    model_type = model.get("architecture") or config_json.get("model_type")
    values = dict(ARCHITECTURE_DEFAULTS.get(model_type, {}))
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
        intermediate_size=_count(values.get("intermediate_size")) or (4 * hidden if model_type == "gpt2" else None),
        vocab_size=_count(values.get("vocab_size")),
        max_position_embeddings=_count(values.get("max_position_embeddings"), minimum=0),
        tie_word_embeddings=bool(values.get("tie_word_embeddings", True)),
        type_vocab_size=_count(values.get("type_vocab_size"), minimum=0) or 0,
        num_key_value_heads=_count(values.get("num_key_value_heads")),
        attention_bias=bool(values.get("attention_bias", False)),
        mlp_bias=bool(values.get("mlp_bias", False)),
        relative_attention=bool(values.get("relative_attention", False)),
        position_biased_input=bool(values.get("position_biased_input", True)),
    )


def _count(value, minimum: int = 1) -> int | None:
    """A dimension as an int; anything else (a list, a string: reported by the model.config check) is unknown."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None


def read_local_config(name_or_path: str | None) -> dict | None:
    """The parsed `config.json` of a local checkpoint directory, or None for hub ids and missing files."""
    if not name_or_path:
        return None
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
