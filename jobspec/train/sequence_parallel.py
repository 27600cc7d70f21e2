"""Ulysses sequence parallelism on the ranks (`memory.sequence_parallel: N`, DeepSpeed's ALST for HF
models).

The world is split into groups of N consecutive ranks (DeepSpeed's parallel_state_sp: ranks
[iN, (i+1)N) form group i). Within a group:

- Data: every rank of the group loads the same micro-batch -- the sampler runs over the
  data-parallel world (world / N ranks, this group's index as the rank: `data_rank`), so the batch
  split, resuming mid-epoch and resharding count exactly as without SP -- and keeps its 1/N slice of
  the sequence (`shard`). DeepSpeed's UlyssesSPDataLoaderAdapter does the same slicing after an
  all-gather of one micro-batch from each of the group's ranks; jobspec does not use it because its
  ranks then read different micro-batches, so a checkpoint would have to hold the micro-batches the
  adapter has gathered but not yet served, and an epoch whose micro-batch count is not a multiple of
  N would leave some ranks waiting in its all-gather for ever. The slice is what the adapter makes:
  the labels shifted by one (the label of the sequence's last token, which predicts nothing, is
  -100) before slicing, so a shard's last token is trained on the next shard's first; position ids
  (0..L-1, what the model would make itself) sliced alike, as Ulysses gathers them back for the
  attention; a `padding: longest` batch padded to a multiple of N (labels -100 there: padding sits
  after every real token, so causal attention keeps it out of their context).
- Attention: UlyssesSPAttentionHF.register_with_transformers puts DeepSpeed's wrapper in
  transformers' ALL_ATTENTION_FUNCTIONS under the model's own implementation (sdpa or
  flash_attention_2): an all-to-all gives each rank the whole sequence for heads / N heads, the
  attention runs, a second all-to-all returns to the sequence shards. It also builds the process
  groups (the mpu that `deepspeed.initialize` takes: DeepSpeed then reduces gradients over the whole
  world and divides by world / N, and counts world / N data-parallel ranks in its batch arithmetic).
- Loss: the model gets no labels (with `memory.tiled_loss`, the shard's next-token labels as
  `shift_labels`, which the tiled head takes: model/tiling.py); each rank sums the cross-entropy of
  its shard's labelled next tokens,
  and the step's loss divides by the labelled tokens of the global batch counted over every rank,
  each rank its shard (jobspec.train.token_loss: `labelled_count(..., shift=0)`, `summed_loss`).
  DeepSpeed sums the gradients of a group's ranks and averages over world / N (`data_world`: its
  `engine.dp_world_size` is None under Ulysses), so the gradient is that of the token mean over the
  global batch -- the loss one rank without SP computes.
- Tokens and samples are counted once per group (its rank 0) in throughput and MFU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobspec.errors import spec_error
from jobspec.spec.types import JobSpec
from jobspec.tasks.base import IGNORE_INDEX
from jobspec.techniques import fused_kernels as kernel_rules
from jobspec.techniques import sequence_parallel as rules

# the attention functions Ulysses replaced in ALL_ATTENTION_FUNCTIONS, by implementation: a rebuilt
# engine (training.on_oom) wraps the original again, never the wrapper
_ORIGINAL_ATTENTION: dict[str, Any] = {}
_ACTIVE: list["SequenceParallel | None"] = [None]


@dataclass
class SequenceParallel:
    size: int              # N: ranks per sequence
    rank: int              # this rank's place in its group: which 1/N of the sequence it holds
    group: Any             # the group's process group
    data_rank: int         # the group's index: the sampler's rank
    data_world: int        # world / N: the sampler's world
    # deepspeed.runtime.sequence_parallel.parallel_state_sp, for deepspeed.initialize
    mpu: Any
    # the model takes the shard's labels (`shift_labels`): memory.tiled_loss, or Liger's fused loss
    # (model.kernels: liger), computed from the hidden states (model/tiling.replace_head_loss)
    tiled_loss: bool = False

    def averaged_over(self, engine) -> int:
        """The ranks DeepSpeed divides the summed gradients by (what the token loss's scale undoes):
        the data-parallel world, world / N -- except ZeRO-3 with reduce-scatter (its default), whose
        reduce_scatter_coalesced averages over every rank of the group without DeepSpeed's
        correction for the sequence-parallel ranks (stage3.__avg_scatter_grads; the contiguous
        all-reduce path has it). Measured against one rank in docs/benchmarks.md (sequence
        parallelism, ZeRO-3)."""
        optimizer = getattr(engine, "optimizer", None)
        if engine.zero_optimization_stage() == 3 and getattr(optimizer, "reduce_scatter", False):
            return self.data_world * self.size
        return self.data_world

    @property
    def counts_data(self) -> bool:
        """Whether this rank counts the group's samples and tokens (once per group)."""
        return self.rank == 0

    def shard(self, batch: dict) -> tuple[dict, Any]:
        """(model inputs of this rank's 1/N of the sequence, the next-token labels of those
        positions), from a host micro-batch of `input_ids` and `labels` (attention_mask and
        position_ids optional)."""
        import torch
        import torch.nn.functional as F

        ids, labels = batch["input_ids"], batch["labels"]
        rows, length = ids.shape
        pad = (-length) % self.size
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length + pad, dtype=torch.long).expand(rows, length + pad)
        elif pad:
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1)], dim=1)
        # padding after the real tokens: ignored by the loss, never in a real token's context
        if pad:
            ids = F.pad(ids, (0, pad), value=0)
            labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)
        next_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        chunk = (length + pad) // self.size
        part = slice(self.rank * chunk, (self.rank + 1) * chunk)
        inputs = {"input_ids": ids[:, part].contiguous(),
                  "position_ids": positions[:, part].contiguous()}
        if self.tiled_loss:   # the tiled or fused head sums the shard's loss (model/tiling.py)
            inputs["shift_labels"] = next_labels[:, part].contiguous()
        return inputs, next_labels[:, part].contiguous()


def active() -> SequenceParallel | None:
    """The sequence parallelism of the engine built last on this rank (None without it)."""
    return _ACTIVE[0]


def setup(model, spec: JobSpec, micro_batch_size: int) -> SequenceParallel | None:
    """Register Ulysses for `model`'s attention and build the sequence-parallel groups (collective:
    every rank calls it); None when `memory.sequence_parallel` is 1."""
    size = spec["memory"]["sequence_parallel"]
    if size == 1:
        _ACTIVE[0] = None
        return None
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    problem = rules.model_problem(getattr(config, "model_type", None))
    if problem is not None:   # a hub id validation could not look into
        raise spec_error(problem[0], path=("memory", "sequence_parallel"), hint=problem[1])
    attention = config._attn_implementation
    restore()
    _ORIGINAL_ATTENTION[attention] = ALL_ATTENTION_FUNCTIONS[attention]
    try:
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=attention,
            sequence_parallel_size=size,
            micro_batch_size=micro_batch_size, seq_length_is_variable=True)
    # DeepSpeed's own refusals (heads of a hub model, its transformers version)
    except ValueError as err:
        raise spec_error(f"DeepSpeed's Ulysses refuses this model: {err}",
                         path=("memory", "sequence_parallel"),
                         hint="set `memory.sequence_parallel: 1`") from err
    world = dist.get_world_size()
    sp = SequenceParallel(size=size, rank=mpu.get_sequence_parallel_rank(),
                          group=mpu.get_sequence_parallel_group(),
                          data_rank=dist.get_rank() // size, data_world=world // size, mpu=mpu,
                          tiled_loss=bool(spec["memory"]["tiled_loss"])
                          or kernel_rules.fused_loss(spec))
    _ACTIVE[0] = sp
    return sp


def restore() -> None:
    """Put back the attention functions Ulysses wrapped and forget its groups (a rebuilt engine
    registers again; in-process tests end with it)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, function in _ORIGINAL_ATTENTION.items():
        ALL_ATTENTION_FUNCTIONS[name] = function
    _ORIGINAL_ATTENTION.clear()
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        parallel_state_sp._release_sequence_parallel_groups()
    _ACTIVE[0] = None
