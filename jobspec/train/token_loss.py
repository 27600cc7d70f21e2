"""The training loss of an optimizer step, whatever the split of its global batch (docs/loss.md).

    loss(step) = sum of the per-token losses of every labelled token of the global batch
                 / the number of labelled tokens of the global batch

(`model.task: sequence-classification`: one label per sample, so the per-sample mean.) A mean per
micro-batch, averaged over accumulation and ranks with equal weight, would weigh a micro-batch of
three short answers like one of long ones: the gradient would depend on `micro_batch_size`, the
number of GPUs and `memory.fit` (the bug transformers' Trainer fixed in 4.46 with
`num_items_in_batch`).

So each rank, before the first forward of an optimizer step, counts the labelled tokens of the
step's micro-batches on the host (`labelled_count`), sums the counts over the ranks that hold the
global batch's tokens (`global_count`: one host all-reduce per step over the groups it is given;
under sequence parallelism each rank counts its own shard's labels), and back-propagates each
micro-batch's SUMMED loss times `backward_scale`, which undoes DeepSpeed's averaging of the
gradients over the data-parallel ranks (`engine.backward(..., scale_wrt_gas=False)` skips its
1/accumulation): the accumulated, averaged gradient is then exactly the gradient of loss(step). fp16
loss scaling and gradient clipping act on that gradient unchanged.

The summed loss of a micro-batch is the model's own loss (the head's: cross-entropy with its shift
and -100s, or MSE/BCE by `problem_type`; a tiled loss's sum) times the labelled tokens it averaged
over: the model and the planner's trace run the model's own loss unchanged, and mean x count is the
sum to within one rounding of fp32 (summing in another order than the model would differ by as
much).
"""
from __future__ import annotations

from typing import Any

from jobspec.tasks.base import CLASS, IGNORE_INDEX, Task


def per_sample(task: Task) -> bool:
    """Whether the task's loss is per sample (one label each) rather than per labelled token."""
    return task.labels == CLASS


def labelled_count(task: Task, labels, shift: int | None = None) -> int:
    """The labelled tokens of one host micro-batch (its samples for a per-sample task). `shift`
    (default: the task's) drops the first `shift` labels of each sequence, which no logit predicts;
    sequence parallelism passes 0 for labels it shifted before splitting the sequence."""
    return int(_counted(task, labels, task.shift if shift is None else shift).sum())


def _counted(task: Task, labels, shift: int):
    """Which labels the loss counts: -100 is ignored -- on tokens, and on a sequence's class too (no
    training sample has it; evaluation's padding batch, jobspec.data.loaders._WithPadding, has only
    it)."""
    return labels != IGNORE_INDEX if per_sample(task) else labels[..., shift:] != IGNORE_INDEX


def global_count(local: int, groups=()) -> int:
    """`local` summed over the ranks of each process group in turn (none: the default group). The
    groups must together span the ranks whose tokens make up the global batch, each rank once: every
    rank (the worker passes its gloo control group: a host all-reduce, no GPU sync), which under
    sequence parallelism is right when each rank counts the labels of its own shard."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    count = torch.tensor([local], dtype=torch.int64)
    for group in groups or (None,):
        on_gpu = dist.get_backend(group) == "nccl"   # NCCL reduces device tensors only
        reduced = count.cuda() if on_gpu else count
        dist.all_reduce(reduced, group=group)
        count = reduced.cpu()
    return int(count.item())


def backward_scale(tokens: int, averaged_over: int) -> float:
    """What a micro-batch's summed loss is multiplied by before `engine.backward(...,
    scale_wrt_gas=False)`: 1/`tokens` (the global batch's labelled tokens), times `averaged_over`
    (the ranks DeepSpeed averages the gradients over: `engine.dp_world_size`) to undo that average.
    0 for a global batch without a labelled token: the step changes nothing."""
    return averaged_over / tokens if tokens else 0.0


def backward(engine, loss) -> None:
    """`engine.backward` of a loss already normalised by the global batch's labelled tokens: without
    DeepSpeed's division by the accumulation steps."""
    engine.backward(loss, scale_wrt_gas=False)


def summed_loss(task: Task, outputs, labels, shift: int | None = None):
    """The sum of the per-token (per-sample) losses of one micro-batch, a 0-d fp32 tensor, from the
    model's outputs: the summed loss a tiled loss returns (`loss_sum`, jobspec/model/tiling.py);
    else the head's loss, the mean over the labelled tokens (samples), times their count; else, for
    a model called without labels (sequence parallelism: `labels` are its shard's next tokens,
    `shift` 0), the cross-entropy of the logits summed in fp32 as transformers' losses compute
    it."""
    import torch
    import torch.nn.functional as F
    def get(name: str) -> Any:
        return outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name, None)
    loss_sum = get("loss_sum")
    if loss_sum is not None:
        return loss_sum.float()
    loss = get("loss")
    if loss is None and isinstance(outputs, tuple) and outputs[0].dim() == 0:
        loss = outputs[0]   # `return_dict: false` with labels: (loss, logits, ...)
    if loss is not None:
        count = _counted(task, labels, task.shift if shift is None else shift).sum()
        # a micro-batch without a labelled token: the mean is 0/0; its gradient is zero all the same
        return torch.where(torch.as_tensor(count, device=loss.device) > 0, loss.float() * count,
                           torch.nan_to_num(loss.float()) * 0.0)
    logits: Any = outputs[0] if isinstance(outputs, tuple) else get("logits")
    shift = task.shift if shift is None else shift
    if shift:   # logits at i predict the label at i + shift (causal-lm: the next token)
        logits, labels = logits[..., :-shift, :], labels[..., shift:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def loss_inputs(task: Task, sp, batch: dict):
    """(the model's inputs, the labels its summed loss is taken against, their shift) of one host
    micro-batch; under sequence parallelism (`sp`: jobspec.train.sequence_parallel.active()) this
    rank's 1/N of the sequence and its next-token labels, shifted already."""
    from jobspec.model.padding_mask import model_inputs
    if sp is not None:
        inputs, next_labels = sp.shard(batch)
        return inputs, next_labels, 0
    return model_inputs(batch, causal=task.shift > 0), batch["labels"], task.shift
