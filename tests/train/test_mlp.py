"""The built-in deep MLP (`model.architecture: mlp`): it trains, its size is known without building it,
the every-k-th-layer checkpointing patch finds and recomputes its layers, and the planner's activation
model matches the bytes autograd really saves (including the surprise: one-layer-in-k saves nothing)."""
from __future__ import annotations

import pytest
import torch

from bench import checkpoint_segments as bench
from conftest import REPO_ROOT as REPO
from jobspec.compile.compiler import compile_spec
from jobspec.errors import SpecError
from jobspec.model.mlp import MLPClassifier, MLPConfig, build_mlp
from jobspec.model.build import build_model
from jobspec.model.planner_trace import ModelTracer
from jobspec.spec.derived import derive
from jobspec.spec.model_dims import model_dims
from jobspec.spec.schema import fill_defaults
from jobspec.model.structure import checkpoint_every_nth_layer, find_layer_stack
from jobspec.train.patches import apply_patches
from jobspec.spec.validation import load_and_validate
from test_patches import _recomputed_layers

BASE = REPO / "jobs" / "mlp-ckpt-base.yaml"
TINY_SETS = ("model.config.hidden_size=16", "model.config.num_layers=8", "model.config.vocab_size=64",
             "data.synthetic.vocab_range=[0, 64]", "training.micro_batch_size=4")


def tiny(layers: int = 8, hidden: int = 16, num_labels: int = 3) -> MLPClassifier:
    torch.manual_seed(0)
    return MLPClassifier(MLPConfig(hidden_size=hidden, num_layers=layers, vocab_size=64, num_labels=num_labels)).train()


def batch(size: int = 6, seq: int = 5, num_labels: int = 3) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (size, seq), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, num_labels, (size,), generator=generator)}


def test_job_spec_builds_the_mlp_and_it_trains_one_step():
    spec = load_and_validate(BASE, TINY_SETS).spec
    model = build_model(spec)
    assert isinstance(model, MLPClassifier) and len(model.layers) == 8 and model.config.hidden_size == 16
    model, notes = apply_patches(model, compile_spec(spec, derive(spec)).patches)
    assert any("attention: none" in note for note in notes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = batch(num_labels=2)
    before = [p.detach().clone() for p in model.parameters()]
    out = model(**data)
    assert out.logits.shape == (6, 2) and out["loss"] is out.loss and torch.isfinite(out.loss)
    out.loss.backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert model(**data).loss < out.loss       # a step down the gradient lowers this batch's loss


def test_padding_does_not_change_the_pooled_sample():
    model, data = tiny(), batch()
    padded = data["input_ids"].clone()
    padded[0, 3:] = 7                          # different ids under the mask: same logits
    a = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    b = model(input_ids=padded, attention_mask=data["attention_mask"]).logits
    # exact: a masked position enters the pooled sum as h * 0 = 0, so the sums are the same floats
    assert torch.equal(a, b) and not torch.allclose(a[0], model(input_ids=padded).logits[0])


@pytest.mark.parametrize("hidden, layers, vocab, labels", [(16, 8, 64, 3), (48, 3, 1000, 2), (4096, 16, 1024, 2)])
def test_parameter_count_is_exact(hidden, layers, vocab, labels):
    spec = fill_defaults({"model": {"architecture": "mlp", "num_labels": labels,
                                    "config": {"hidden_size": hidden, "num_layers": layers, "vocab_size": vocab}}})
    dims = model_dims(spec)
    assert (dims.hidden_size, dims.num_layers, dims.vocab_size) == (hidden, layers, vocab)
    with torch.device("meta"):                 # the 4096-wide one without allocating it
        model = build_mlp(spec)
    inventory = ModelTracer({**spec, "training": {"seed": 0}}).inventory()
    assert inventory.total == sum(p.numel() for p in model.parameters())
    vectors = sum(shape[0] for _, shape, _ in inventory.tensors if len(shape) == 1)
    assert vectors == layers * hidden + labels                     # the biases
    assert inventory.num_layers == layers and inventory.layer_params == hidden * hidden + hidden


def test_bad_mlp_config_is_a_spec_error():
    with pytest.raises(SpecError, match="num_hidden_layers"):
        build_mlp(fill_defaults({"model": {"architecture": "mlp", "config": {"num_hidden_layers": 4}}}))
    with pytest.raises(SpecError, match="sequence-classification"):
        build_mlp(fill_defaults({"model": {"architecture": "mlp", "task": "causal-lm"}}))


@pytest.mark.parametrize("k, expected", [(1, list(range(8))), (2, [0, 2, 4, 6]), (3, [0, 3, 6]), (8, [0])])
def test_checkpointing_every_k_recomputes_those_layers(k, expected):
    model = tiny()
    assert find_layer_stack(model) is model.layers
    apply_patches(model, [{"name": "gradient_checkpointing", "args": {"every_n_layers": k}}])
    assert sorted(_recomputed_layers(model, batch())) == expected
    assert _recomputed_layers(tiny(), batch()) == []


def saved_bytes(model, data) -> bench.SavedTensors:
    saved = bench.SavedTensors(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        loss = model(**data).loss
    loss.backward()
    return saved


def test_one_layer_in_k_saves_nothing_on_an_mlp_but_segments_do():
    """A layer's input is the previous ReLU's output (one storage), so checkpointing a layer, which
    keeps its input, frees nothing: off, k=1 and k=2 save the same bytes. Segments of layers do."""
    data = batch(size=32, seq=4)
    matrix = 32 * 16 * 4
    off = saved_bytes(tiny(), data).total
    every = {}
    for k in (1, 2):
        model = tiny()
        checkpoint_every_nth_layer(model, k)
        every[k] = saved_bytes(model, data).total
    assert every[1] == every[2] == off
    # 8 layer outputs + the pooled input, plus ids, pooling weights, logits, labels (< 2 matrices here)
    assert 9 * matrix <= off < 11 * matrix
    segments = bench.build(16, 8, torch.device("cpu"), segments=4)
    saved = bench.SavedTensors(segments)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        bench.step(segments, {"input_ids": data["input_ids"], "labels": data["labels"] % 2})
    assert saved.total < off - 2.5 * matrix    # 3 segment inputs + the last segment's 2 layers + input: 6, not 9


@pytest.mark.parametrize("k", [None, 1, 4])
def test_planner_activations_match_the_saved_bytes(k):
    """The trace's peak against the bytes autograd saves (a batch large enough that the trace's
    512-byte allocator rounding of the small tensors (labels, ids) does not matter): the peak holds
    every saved tensor, plus the temporaries of the moment: the (b, s, h) embedding output before its
    mean-pool and the gradients in flight."""
    b, seq = 512, 4
    sets = TINY_SETS + (f"training.micro_batch_size={b}", f"data.synthetic.seq_len={seq}")
    spec = load_and_validate(BASE, sets + ((f"memory.activation_checkpointing={{every_n_layers: {k}}}",)
                                           if k else ())).spec
    model = build_model(spec)
    if k:
        checkpoint_every_nth_layer(model, k)
    data = batch(size=b, seq=seq, num_labels=2)
    measured = saved_bytes(model, data).total
    setting = {"every_n_layers": k} if k else False
    planned = ModelTracer(spec).profile("fp32", b, seq, setting).activations.peak
    matrix = 4 * b * 16
    assert measured <= planned <= measured + 4 * seq * matrix + 2 * matrix, (planned, measured)


def test_bench_prints_both_kinds_of_rows(capsys):
    assert bench.main(["--hidden", "128", "--batch", "256", "--layers", "8", "--every", "2",
                       "--sequential", "4", "--repeats", "1"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "checkpointing" not in line}
    assert set(rows) == {"off", "every 2", "segments 4"}
    saved = {name: float(cells[0]) for name, cells in rows.items()}
    assert saved["every 2"] == saved["off"] > saved["segments 4"]
    assert rows["every 2"][3].strip() == "0.50" and rows["segments 4"][5].strip() == "-"
