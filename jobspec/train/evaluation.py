"""Evaluation on the ranks: the policy (`Evaluator`: when, and what follows an evaluation) and the
pass itself (`evaluate`: the eval loss per labelled token and the task metrics, over every rank).

`Evaluator.should_run(step, last_step=)`: every `training.eval_every` steps and at the last step.
An evaluation is the eval data's loss and metrics (nothing without eval data), logged and offered
to the exporter's best-eval export, then the generation policy's answers (train/generation: none
without `training.eval_generate`), which run at every evaluation, with or without eval data.
"""
from __future__ import annotations

from typing import Any, Callable

from jobspec.spec.types import JobSpecTraining


class Evaluator:
    """`training.eval_every` on the ranks (module docstring). `run` is collective."""

    def __init__(self, training: JobSpecTraining, eval_ds, new_counter: Callable[[Any], Any], *,
                 reporter, exporter, generator):
        self.every = training["eval_every"]
        self.eval_ds = eval_ds          # None: no eval data (the generation may still run)
        # the model's config -> its task's TaskCounter (task_metrics.counter_for)
        self.new_counter = new_counter
        self.reporter, self.exporter, self.generator = reporter, exporter, generator

    def should_run(self, step: int, *, last_step: bool) -> bool:
        return bool(self.every and step % self.every == 0) or last_step

    def run(self, engine, state, loader_args: dict) -> None:
        """One evaluation at `state.step`: `loader_args` are make_loader's keywords of the run's
        current split (micro-batch, this rank's data rank and world)."""
        if self.eval_ds is not None:
            from jobspec.data.loaders import make_loader
            loader = make_loader(self.eval_ds, epoch=0, shuffle=False, skip_batches=0,
                                 **loader_args)
            counter = self.new_counter(getattr(engine.module, "config", None))
            state.eval_loss, state.eval_metrics = evaluate(engine, loader, counter)
            self.reporter.log_eval(state.step, state.eval_loss, state.eval_metrics)
            self.exporter.after_eval(engine, state)
        self.generator.run(engine, state)


def evaluate(engine, loader, counter=None, task=None) -> tuple[float, dict]:
    """(the eval loss: per labelled token over every rank's batches, the task metrics of `counter`
    by name).

    The loss is the summed per-token loss of every rank's batches over their labelled tokens
    (jobspec.train.token_loss: the training loss's definition), so a perplexity is exp of it
    whatever the eval micro-batch and the ranks. The metrics come from counts summed over the ranks
    (jobspec.train.task_metrics), never from a mean of the ranks' own metrics. With sequence
    parallelism the group's ranks evaluate the same batches, each its shard of the tokens (counted
    once in the loss; the task metrics count the group's batch once, by its rank 0)."""
    import torch
    import torch.distributed as dist

    from jobspec import tasks
    from jobspec.train import sequence_parallel, token_loss
    from jobspec.train.task_metrics import logits_of, perplexity
    sp = sequence_parallel.active()
    task = tasks.get(counter.task if counter is not None else task)
    # the summed loss, the labelled tokens
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    engine.eval()
    with torch.no_grad():
        for batch in loader:
            inputs, labels, shift = token_loss.loss_inputs(task, sp, batch)
            count = token_loss.labelled_count(task, labels, shift)
            inputs = {k: v.to(engine.device, non_blocking=True) for k, v in inputs.items()}
            outputs = engine(**inputs)
            labels = labels.to(engine.device, non_blocking=True)
            summed = token_loss.summed_loss(task, outputs, labels, shift)
            totals += torch.stack([summed.double(), torch.tensor(float(count), dtype=torch.float64,
                                                                 device=engine.device)])
            if counter is not None and (sp is None or sp.counts_data):
                # a shard's logits are not the batch's: under sequence parallelism the loss only
                mean = summed / count if count else summed
                counter.update(mean, logits_of(outputs) if sp is None else None,
                               batch["labels"].to(engine.device, non_blocking=True))
    engine.train()
    dist.all_reduce(totals)
    loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    if counter is None:
        return loss, {}
    counts = counter.vector(engine.device)
    dist.all_reduce(counts)
    metrics = counter.finish(counts.tolist())
    # exp(eval/loss) exactly: the same sums (the counter's come back from means)
    if "perplexity" in metrics:
        metrics.update(perplexity(float(totals[0]), float(totals[1])))
    return loss, metrics
