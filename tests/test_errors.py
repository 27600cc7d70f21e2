"""jobspec/errors.py: the one did-you-mean hint, in each form its callers ask for."""
from __future__ import annotations

import pytest

from jobspec.errors import close_choices, did_you_mean

KEYS = ["hidden_size", "num_layers", "vocab_size"]


def test_the_same_letters_in_another_case_come_first():
    assert close_choices("BF16", ["fp16", "bf16", "fp32"]) == ["bf16"]
    assert close_choices("hiden_size", KEYS) == ["hidden_size"]
    assert close_choices("zzz", KEYS) == []


@pytest.mark.parametrize("kwargs, hint", [
    ({}, "did you mean `hidden_size`?"),
    ({"beside": 3}, "did you mean `hidden_size`? keys: `hidden_size`, `num_layers`, `vocab_size`"),
    ({"beside": 2}, "did you mean `hidden_size`?"),
    ({"quote": "'", "prefix": "model.config."}, "did you mean 'model.config.hidden_size'?"),
])
def test_a_close_choice_is_named(kwargs, hint):
    assert did_you_mean("hiden_size", KEYS, "keys", **kwargs) == hint


@pytest.mark.parametrize("kwargs, hint", [
    ({}, "keys: `hidden_size`, `num_layers`, `vocab_size`"),
    ({"shown": 1}, "keys: `hidden_size`, and 2 more"),
    ({"shown": 2, "more": "schemas/x.json"}, "keys: `hidden_size`, `num_layers`, and 1 more in schemas/x.json"),
    ({"otherwise": "name a key"}, "name a key"),
])
def test_nothing_close_lists_the_choices_or_says_otherwise(kwargs, hint):
    assert did_you_mean("zzz", KEYS, "keys", **kwargs) == hint


def test_several_close_choices_are_named_together():
    assert did_you_mean("q_prj", ["q_proj", "k_proj", "o_proj"], n=3, quote="'") == \
        "did you mean 'q_proj' or 'o_proj' or 'k_proj'?"
