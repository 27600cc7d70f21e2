"""`model.compile` on the ranks (train/regional_compile.py): each layer of the layer stack compiled
in place, one compiled graph for all of them, the checkpointing wrappers and the LoRA adapters
inside; the compile time reported once after the first optimizer step. In process with dynamo's
`eager` backend (it traces the graphs, compiles nothing: seconds); the CPU-rank launches with
inductor, compile on against off, are in test_regional_compile_launch.py."""
from __future__ import annotations

import copy

import pytest
import torch
from spec_builder import BARE, build_spec

from jobspec.compile.compiler import lora_patch_args
from jobspec.model.build import build_model
from jobspec.train import regional_compile
from jobspec.train.patches import apply_patches

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 64}
EAGER = {"name": "torch_compile", "args": {"backend": "eager"}}


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """A clean dynamo cache and counters, and a clock of the test's own (the process has one)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(regional_compile.CompileClock, "_instance", None)
    yield
    clock = regional_compile.CompileClock._instance
    if clock is not None:   # the test's dynamo callbacks and optimizer hook go with it
        clock.stop()
    torch._dynamo.reset()


def make_spec(tmp_path, **model) -> dict:
    model = {"architecture": "llama", "task": "causal-lm", "config": LLAMA, **model}
    return build_spec(base=BARE, name="compile-unit", model=model,
                      training={"max_steps": 1, "seed": 3}, output_dir=str(tmp_path / "out"),
                      data={"synthetic": {"vocab_range": [5, 128], "seq_len": 16}})


def frames() -> int:
    from torch._dynamo.utils import counters
    return int(counters["frames"]["ok"])


def losses(model, steps: int = 3) -> list[float]:
    ids = torch.randint(5, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("checkpointing", [None, 1, 2])
def test_every_layer_compiled_in_place_one_graph_for_all(tmp_path, checkpointing, capsys):
    spec = make_spec(tmp_path)
    base = build_model(spec)
    patches = [] if checkpointing is None else [
        {"name": "gradient_checkpointing",
         "args": {"every_n_layers": checkpointing, "use_reentrant": False}}]
    eager, _ = apply_patches(copy.deepcopy(base), patches)
    eager.config.use_cache = False   # as the patch sets it: the same forward, with no cache built
    model, notes = apply_patches(copy.deepcopy(base), [*patches, EAGER])
    layers = model.model.layers
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.use_cache is False
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert model.model.embed_tokens._compiled_call_impl is None   # only the layers
    assert notes[-1].startswith(
        "torch.compile: regional, on each of the 4 layers (LlamaDecoderLayer)")
    assert losses(model) == pytest.approx(losses(eager), rel=1e-6)
    # one graph whatever the depth; checkpointing one layer in 2 adds the unwrapped layer's
    assert frames() == (2 if checkpointing == 2 else 1)


def test_lora_adapters_are_inside_the_compiled_layers(tmp_path):
    spec = make_spec(tmp_path, lora={"r": 4, "alpha": 8, "dropout": 0.0})
    lora = {"name": "lora", "args": {**lora_patch_args(spec), "enable_input_require_grads": True}}
    ckpt = {"name": "gradient_checkpointing", "args": {"every_n_layers": 1, "use_reentrant": False}}
    model, notes = apply_patches(build_model(spec), [ckpt, lora, EAGER])
    # not replaced: PEFT's model, its layers compiled
    assert type(model).__name__.startswith("PeftModel")
    layers = model.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert any("lora_A" in name for name, _ in layers[0].named_parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses(model, steps=2)
    moved = [n for n, p in model.named_parameters()
             if p.requires_grad and not torch.equal(before[n], p)]
    # the adapters train through the compiled layers
    assert moved and all("lora_" in n for n in moved)
    assert frames() == 1


def test_a_model_without_a_layer_stack_is_compiled_whole():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    compiled, notes = apply_patches(model, [EAGER])
    assert compiled is not model and compiled._orig_mod is model
    assert "the whole Sequential" in notes[0]


def test_the_compile_time_is_reported_once_after_the_first_optimizer_step(tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("RANK", "1")
    model, _ = apply_patches(build_model(make_spec(tmp_path)), [EAGER])
    capsys.readouterr()
    losses(model, steps=1)
    lines = capsys.readouterr().out.splitlines()
    clock = regional_compile.CompileClock._instance
    assert clock is not None and clock.compilations >= 1 and clock.seconds > 0
    phase, note = lines
    assert phase.startswith("jobspec-log: phase rank1 compiled ")
    assert float(phase.split()[4]) == pytest.approx(clock.last_end)
    assert note == f"jobspec-log: {clock.note()}"
    assert f"torch.compile: {clock.seconds:.1f} s for " in note
    assert "inside the first step" in note
    losses(model, steps=2)   # later steps say nothing more
    assert capsys.readouterr().out == ""
