"""The planner under `memory.sequence_parallel: N`: a rank's activations are the trace of its 1/N of the
sequence (spec/derived), its FLOPs per token the whole sequence's, and Ulysses' all-to-all buffers
(memory/ulysses_buffers.py) come on top of the forward/backward peak."""
from __future__ import annotations

from spec_builder import build_spec

from jobspec.memory.planner import plan_memory
from jobspec.memory.ulysses_buffers import all_to_all_bytes
from jobspec.model.planner_trace import job_profiler
from jobspec.spec.derived import derive

PROFILER = job_profiler()
HIDDEN, HEADS, KV = 64, 4, 2


def _spec(seq_len: int, n: int) -> dict:
    return build_spec(base={
        "model": {"architecture": "llama", "task": "causal-lm",
                  "config": {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": HEADS, "num_key_value_heads": KV, "vocab_size": 512,
                             "max_position_embeddings": 1024}},
        "data": {"synthetic": {"num_samples": 16, "seq_len": seq_len}},
        "training": {"max_steps": 2, "micro_batch_size": 2},
        "memory": {"precision": "bf16", "sequence_parallel": n},
        "resources": {"gpus_per_node": 4}})


def test_a_rank_plans_its_shard_of_the_sequence_and_the_exchange():
    sp = derive(_spec(512, 4), profiler=PROFILER)
    shard = derive(_spec(128, 1), profiler=PROFILER)          # one rank's 1/4 of the sequence, no SP
    whole = derive(_spec(512, 1), profiler=PROFILER)
    assert sp.profile.activations.regions == shard.profile.activations.regions
    assert sp.model_flops_per_token == whole.model_flops_per_token          # attention over all 512 tokens
    assert sp.model_flops_per_token > shard.model_flops_per_token
    assert any("1/4 of the sequence (128 tokens)" in note for note in sp.profile.notes)

    plan, plain = plan_memory(_spec(512, 4), sp), plan_memory(_spec(128, 1), shard)
    # q (4 heads) + k, v (2 kv heads, repeated to 4 ranks) + the context, per token of the shard, sent and received
    exchange = 2 * (2 * 128) * (HIDDEN // HEADS) * (HEADS + 2 * max(KV, 4) + HEADS) * 2
    assert all_to_all_bytes(sp) == exchange == plan.breakdown["all_to_all_buffers"]
    assert plan.peak_allocated == plain.peak_allocated + exchange
    assert plan.settings["sequence_parallel"] == 4
    assert plan_memory(_spec(512, 1), whole).breakdown["all_to_all_buffers"] == 0
    assert plan.breakdown["activations"] < plan_memory(_spec(512, 1), whole).breakdown["activations"]


def test_the_fit_search_splits_the_batch_over_the_data_parallel_ranks():
    """plan --fit (and --longest) under SP: micro-batches that divide the global batch over world / N ranks."""
    from jobspec.memory.fit import candidate_changes
    spec = _spec(512, 4)
    spec["training"]["global_batch_size"] = 2    # micro 2 x (4 / 4 = 1 data-parallel rank) x 1
    job = derive(spec)
    micros = {changes.get("training.micro_batch_size", 2) for changes in candidate_changes(spec, job, True)}
    assert micros == {2, 1}
