"""What Ulysses sequence parallelism (`memory.sequence_parallel: N`) costs one rank beyond its
traced shard.

The derived job traces the model at the per-rank sequence, seq_len / N (spec/derived.py): every
layer's activations, the embeddings, the logits and the loss of a rank are those of its shard, since
Ulysses hands each rank the whole sequence only inside attention, for heads / N heads -- the same
number of elements as its shard's heads for its 1/N of the sequence, saved for the backward in place
of them. What the shard's trace does not hold is the exchange itself
(deepspeed.runtime.sequence_parallel. ulysses_sp.UlyssesSPAttentionHF, one layer at a time, forward
and backward alike):

- query, key and value are made contiguous in the head-major layout the all-to-all sends, and the
  all-to-all receives into a buffer of the same size: a send and a receive copy of each, the
  key/value heads repeated up to N when the model has fewer (DeepSpeed's replication of GQA/MQA
  heads);
- the attention output goes back the same way: a send and a receive copy of the context.

`all_to_all_bytes` is that transient, live beside the saved activations while one layer's attention
runs; the planner adds it to the forward/backward peak. Pure.
"""
from __future__ import annotations

from jobspec.spec.derived import DerivedJob

SEND_AND_RECEIVE = 2   # the all-to-all's contiguous input and its output buffer


def all_to_all_bytes(job: DerivedJob) -> int:
    """One rank's transient buffers of one layer's Ulysses exchange, in bytes; 0 without SP or
    dims."""
    n = job.sequence_parallel
    dims = job.dims
    if n <= 1 or dims is None or not dims.num_heads or not dims.hidden_size:
        return 0
    heads, kv = dims.num_heads, dims.num_key_value_heads or dims.num_heads
    head_dim = dims.hidden_size // heads
    shard_tokens = job.micro_batch_size * -(-job.seq_len // n)
    # query + key + value (kv heads replicated up to N) + the context, each at this rank's shard
    # size
    per_token = head_dim * (heads + 2 * max(kv, n) + heads)
    return SEND_AND_RECEIVE * shard_tokens * per_token * job.precision_bytes
