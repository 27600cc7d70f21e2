"""Sequence-length interpolation (model/lengths.py) and `plan --longest` (fit.longest_sequence).

The timeline the planner builds at a long length from its traces at three short ones must be the
one traced at that length, event for event (sizes, regions, where the backward starts, FLOPs), at
two more lengths (one of each residue modulo 128: the flash kernel's scratch rounds to 128): for a
Llama with SDPA (the flash kernel, grouped-query attention), an eager BERT with its padding mask
(s² terms) and a Llama checkpointed with the tiled loss, the tiled MLP and the inputs offloaded
(tile loops whose tile count and tile length change with the length), at micro-batches 1 and 2.
The compact timeline (the middle tiles as lumps) must summarize to the same `UnitTrace`. The
tracer must then plan long lengths from the three traces alone, and `--longest` must find what
tracing every length finds.
"""
from __future__ import annotations

import pytest

from jobspec.model.lengths import Interpolation, TileRules, basis_lengths, interpolate
from jobspec.model.planner_trace import NO_TILING, ModelTracer, job_profiler
from jobspec.model.step import summarize
from jobspec.spec.schema import fill_defaults

LLAMA = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 2000,
         "max_position_embeddings": 1 << 16, "tie_word_embeddings": False, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2}
# tiles of 256 tokens in the MLP, of 512 in the loss (2^30 / (131072 x 16): model/tiling.py)
TILED = {**LLAMA, "hidden_size": 256, "intermediate_size": 768, "vocab_size": 131072}
BERT = {"hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
        "intermediate_size": 192, "vocab_size": 3000, "max_position_embeddings": 1 << 13}
OFFLOADED = {"every_n_layers": 1, "offload": "cpu"}
ALL_TILED = (True, True, True)   # tiled loss (tiles by the bound), tiled MLP, offloaded inputs

pytestmark = pytest.mark.xdist_group("model-tracers")


def spec_for(architecture, config, attention="sdpa", task="causal-lm", checkpointing=False,
             tiled=False, micro_batch=1):
    model = {"architecture": architecture, "task": task, "num_labels": 2, "config": config,
             "attention": attention}
    memory = {"precision": "bf16", "activation_checkpointing": checkpointing, "tiled_loss": tiled,
              "tiled_mlp": tiled}
    return fill_defaults({"model": model, "training": {"seed": 0, "micro_batch_size": micro_batch},
                          "data": {}, "memory": memory})


TILED_SPEC = spec_for("llama", TILED, checkpointing=OFFLOADED, tiled=True)
CASES = {   # spec, precision, checkpointed, tiling, micro-batch, two lengths past the three
    "llama-sdpa": (spec_for("llama", LLAMA), "bf16", False, NO_TILING, 1, (2624, 4096)),
    "bert-eager": (spec_for("bert", BERT, "eager", "sequence-classification"), "fp32", False,
                   NO_TILING, 1, (2624, 3200)),
    "llama-tiled-offload": (TILED_SPEC, "bf16", True, ALL_TILED, 1, (2368, 3584)),
    "llama-tiled-offload-b2": (TILED_SPEC, "bf16", True, ALL_TILED, 2, (1600, 2304)),
}
_TRACERS: dict = {}


def tracer_of(case: str) -> ModelTracer:
    spec = CASES[case][0]
    key = repr(spec["model"]) + repr(spec["memory"])
    if key not in _TRACERS:
        _TRACERS[key] = ModelTracer(spec, interpolate=False)
    return _TRACERS[key]


def basis_and_interpolation(case: str):
    spec, precision, checkpointed, tiling, batch, _ = CASES[case]
    tracer = tracer_of(case)
    types = tuple((kind, checkpointed) for kind in tracer.inventory().layer_kinds)
    tracer._config_for(None)
    rules = tracer._tile_rules(tiling)
    basis = basis_lengths(rules, batch, spec["model"]["config"]["max_position_embeddings"])
    assert basis is not None

    def trace(length: int) -> dict:
        return tracer._trace(precision, batch, length, types=types, tiling=tiling)

    return trace, basis, Interpolation([trace(s) for s in basis], basis, rules, batch)


@pytest.mark.parametrize("case", list(CASES))
def test_the_interpolated_timeline_is_the_traced_one(case):
    trace, basis, interpolation = basis_and_interpolation(case)
    rules, batch = interpolation.rules, CASES[case][4]
    for length in CASES[case][-1]:
        assert length > basis[-1]
        traced, built = trace(length), interpolation.at(length)
        assert built is not None, (case, length)
        assert (built["sizes"], built["regions"], built["backward"], built["flops"]) == \
            (traced["sizes"], traced["regions"], traced["backward"], traced["flops"]), length
        compact = interpolation.at(length, compact=True)
        assert compact is not None and summarize(compact) == summarize(traced)
        if case.startswith("llama-tiled"):   # the tile loops grew; the compact timeline did not
            assert len(compact["sizes"]) < len(traced["sizes"])
            counts = {kind: len(tiles) for kind, _, _, tiles in traced["loops"]}
            assert len(traced["loops"]) == 11
            assert counts == {kind: n for kind, (n, _, _) in rules.tiles(batch, length).items()}
            shortest = rules.tiles(batch, basis[-1])
            assert any(counts[kind] > count for kind, (count, _, _) in shortest.items())


def test_what_the_three_traces_do_not_give_is_traced():
    trace, basis, interpolation = basis_and_interpolation("llama-sdpa")
    assert interpolation.at(basis[-1]) is None               # not past the three
    assert interpolation.at(4096 + 32) is None               # not a multiple of 64
    timelines = [trace(s) for s in basis]
    other = ModelTracer(spec_for("llama", {**LLAMA, "num_hidden_layers": 2}), interpolate=False)
    two = tuple((kind, False) for kind in other.inventory().layer_kinds)
    mixed = [timelines[0], other._trace("bf16", 1, basis[1], types=two), timelines[2]]
    assert interpolate(mixed, basis, 4096, TileRules(), 1) is None
    recorded = ("shapes", "serials", "loops")   # not in a cache entry from before them
    old = {key: value for key, value in timelines[1].items() if key not in recorded}
    assert interpolate([timelines[0], old, timelines[2]], basis, 4096, TileRules(), 1) is None
    assert interpolate(timelines, basis, 4096, TileRules(), 1) is not None


def test_tile_rules_are_the_tiling_code_s():
    import math

    import torch

    from jobspec.model.tiling import default_tiles

    for length in range(64, 9000, 448):
        for batch in (1, 2, 3):
            chunks = TileRules(mlp_hidden=256, loss_vocab=131072).chunks(batch, length)
            # model/tiling._tiled_mlp_forward's tile count, DeepSpeed's TiledMLP's torch.chunk
            pieces = math.ceil(length / 256)
            tokens = [len(c) for c in torch.chunk(torch.empty(length), pieces)]
            rows = [len(c) for c in torch.chunk(torch.empty(batch * length), pieces)]
            assert (chunks["mlp.forward"], chunks["mlp.backward"]) == (tokens, rows)
            # model/tiling.tiled_cross_entropy's tile count, SequenceTiledCompute's slices
            shards = min(length, default_tiles(batch * length, 131072))
            step = math.ceil(length / shards)
            ids = torch.empty(1, length)
            assert chunks["loss.forward"] == [ids[:, i * step:(i + 1) * step].shape[1]
                                              for i in range(shards)]


def traced_lengths(tracer: ModelTracer) -> set:
    return {key[3] for key in tracer._units if key[0] == "timeline"}


@pytest.mark.parametrize("micro_batch", [1, 3])
def test_the_tracer_plans_long_lengths_from_three_traces(micro_batch):
    # micro-batch 3: the timelines at 1 and 2 interpolated, then extrapolated to 3
    spec = spec_for("llama", LLAMA, micro_batch=micro_batch)
    interpolating, tracing = ModelTracer(spec), ModelTracer(spec, interpolate=False)
    for length in (2560, 4160):
        planned = interpolating.profile("bf16", micro_batch, length, False)
        traced = tracing.profile("bf16", micro_batch, length, False)
        assert planned.activations == traced.activations
        assert planned.model_flops_per_token == \
            pytest.approx(traced.model_flops_per_token, rel=1e-12)
    # the first length traced (one trace costs less than three), then the three for the second
    assert traced_lengths(interpolating) == {2560, 1024, 1600, 2048}
    assert {2560, 4160} <= traced_lengths(tracing)


def test_a_tiled_unit_is_interpolated_at_once():
    tracer = ModelTracer(TILED_SPEC)
    tracer.profile("bf16", 1, 6272, OFFLOADED, ALL_TILED)   # more tiles than the three together
    tracer._config_for(None)
    tiled = basis_lengths(tracer._tile_rules(ALL_TILED), 1, None)
    plain = basis_lengths(TileRules(), 1, None)   # the untiled units of the model's FLOPs too
    assert tiled is not None and plain is not None
    assert traced_lengths(tracer) == set(tiled) | set(plain)   # not 6272


# ------------------------------------------------------------------ plan --longest
def longest_setup(checkpointing=False, positions=1 << 16):
    from jobspec.spec.derived import derive

    config = {**LLAMA, "num_hidden_layers": 2, "max_position_embeddings": positions}
    spec = spec_for("llama", config, checkpointing=checkpointing)
    spec["data"]["max_length"] = 2048
    return spec, derive(spec, profiler=job_profiler(use_cache=False))


def plan_at(spec, job, length, **budgets):
    from jobspec.memory.fit import apply_changes, seq_len_path
    from jobspec.memory.planner import plan_memory

    candidate = apply_changes(spec, {seq_len_path(spec): length})
    return plan_memory(candidate, job.with_spec(candidate), **budgets)


def test_longest_finds_what_tracing_every_length_finds():
    from jobspec.memory.fit import longest_sequence
    from jobspec.spec.derived import derive

    spec, job = longest_setup()
    budget = plan_at(spec, job, 5000).nvml_total
    found = longest_sequence(spec, job, budget)
    every = derive(spec, profiler=job_profiler(use_cache=False, interpolate=False))
    exhaustive = longest_sequence(spec, every, budget)
    assert found.seq_len is not None and found.seq_len > 4096 and found.binding == "gpu"
    assert (found.seq_len, found.binding, found.plan.nvml_total) == \
        (exhaustive.seq_len, exhaustive.binding, exhaustive.plan.nvml_total)
    assert not plan_at(spec, job, found.seq_len + 64, budget=budget).fits


def test_a_longer_sequence_never_fits_where_a_shorter_does_not():
    spec, job = longest_setup()
    budget = plan_at(spec, job, 6000).nvml_total
    verdicts = [bool(plan_at(spec, job, length, budget=budget).fits)
                for length in range(2112, 9024, 64)]
    assert verdicts[0] and not verdicts[-1]
    assert verdicts == sorted(verdicts, reverse=True)   # every True before every False


def test_longest_says_what_binds():
    from jobspec.memory.fit import longest_sequence

    spec, job = longest_setup(positions=4096)
    huge = plan_at(spec, job, 4096).nvml_total * 4
    assert longest_sequence(spec, job, huge).binding == "positions"
    assert longest_sequence(spec, job, huge).seq_len == 4096
    # the offloaded checkpoint inputs grow with the sequence (pinned buffers: powers of 2)
    spec, job = longest_setup(checkpointing=OFFLOADED)
    host = plan_at(spec, job, 2048).host_per_node
    bound = longest_sequence(spec, job, huge, host_budget=host)
    assert bound.binding == "host" and bound.seq_len is not None and bound.seq_len < 4096
    over = plan_at(spec, job, bound.seq_len + 64, budget=huge, host_budget=host)
    assert over.gpu_fits and not over.host_fits and over.host["offloaded_activations"] > 0
    assert bound.as_dict()["binding"] == "host"
