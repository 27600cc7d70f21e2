"""The ranks seed Python, NumPy and torch as transformers.set_seed does, without importing PEFT."""
from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import torch

from jobspec.train.engine import seed_everything


def draws():
    return random.random(), float(np.random.rand()), torch.rand(4).tolist(), torch.nn.Linear(3, 2).weight.tolist()


def test_seed_everything_draws_what_transformers_set_seed_draws():
    from transformers import set_seed
    set_seed(1234)
    reference = draws()
    seed_everything(1234)
    assert draws() == reference
    seed_everything(1235)
    assert draws() != reference


def test_a_rank_without_adapters_never_imports_peft_or_bitsandbytes():
    # transformers.trainer_utils (set_seed's module) imports both: ~2.5 s of CPU on every rank
    code = ("import sys; from jobspec.train import engine; engine.seed_everything(0); "
            "from transformers import AutoConfig, AutoModelForSequenceClassification as M; "
            "M.from_config(AutoConfig.for_model('bert', hidden_size=8, num_hidden_layers=1, num_attention_heads=2, "
            "intermediate_size=8, vocab_size=16)); print(sorted({'peft', 'bitsandbytes'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[]"
