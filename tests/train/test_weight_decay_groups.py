"""Weight decay on matrices only by default, for every optimizer (issue 32, item 6): the compiled
`parameter_groups` patch and the groups the ranks' optimizer holds."""
from __future__ import annotations

import pytest
import split_runs
from split_runs import run_files

from jobspec.compile.compiler import compile_patches, patch_text


def _decay(wd: float, on: str | None = None, name: str = "adamw") -> dict:
    optimizer = {"name": name, "weight_decay": wd, "lr": 1e-3}
    if on is not None:
        optimizer["weight_decay_on"] = on
    return {"training": {"optimizer": optimizer}}


def test_the_compiled_patches_show_the_groups():
    spec = run_files("mlm", world=1, micro=16, zero=0, overrides=_decay(0.1)).spec
    groups = [p for p in compile_patches(spec) if p["name"] == "parameter_groups"]
    assert groups == [{"name": "parameter_groups",
                       "args": {"weight_decay": 0.1, "no_decay": "biases and normalisation weights"}}]
    assert patch_text(groups[0]) == "weight decay 0.1 on matrices, none on biases and normalisation weights"
    for off in (_decay(0.1, "all"), _decay(0.0)):   # every parameter decayed alike, or none
        spec = run_files("mlm", world=1, micro=16, zero=0, overrides=off).spec
        assert not [p for p in compile_patches(spec) if p["name"] == "parameter_groups"]


@pytest.mark.parametrize("name, zero", [("adamw", 0), ("sgd", 2), ("adafactor", 0)])
def test_every_optimizer_decays_the_matrices_only(tmp_path, name, zero):
    """The BERT's matrices (2-D: linear weights, embeddings) at the weight decay; its biases and
    LayerNorm weights (1-D) at none -- the rule of transformers' Trainer, checked here by shape."""
    files = run_files("mlm", world=1, micro=16, zero=zero, overrides=_decay(0.1, name=name))
    with split_runs.one_rank_process_group(tmp_path / "store"):
        from jobspec.train.engine import build_engine
        engine, *_ = build_engine(files)
        optimizer = engine.optimizer
        groups = getattr(optimizer, "optimizer", optimizer).param_groups   # ZeRO wraps the torch optimizer
        if zero:   # ZeRO 2 flattens each group: its groups keep the order and the decays of the ones given
            assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        else:
            decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
            named = dict(engine.module.named_parameters())
            assert {n: decay[id(p)] for n, p in named.items()} == {n: 0.1 if p.dim() >= 2 else 0.0
                                                                   for n, p in named.items()}
            assert any(p.dim() == 1 and "LayerNorm" in n for n, p in named.items())
        engine.destroy()
