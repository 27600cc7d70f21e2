"""This rank's micro-batches, one optimizer step's worth at a time, across epoch ends.

The loss of a step is normalised by the labelled tokens of the whole step
(jobspec.train.token_loss), so the step's micro-batches are taken from the loader before its first
forward: host batches of token ids, a few KiB each. A training epoch is whole global batches
(jobspec.data.loaders.epoch_samples), so its micro-batches on a rank are a multiple of the
accumulation and a step ends where an epoch ends; a run resumed at an epoch's end opens that epoch's
(empty) rest and goes on with the next epoch, reshuffled. Should a step still reach past an epoch's
end, its last micro-batches come from the next epoch. Each micro-batch carries the data position
after it (epoch, micro-batches of that epoch), which the loop makes the run's position (checkpoints
resume from it) as it trains that micro-batch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from jobspec.errors import RunFailure


@dataclass
class MicroBatch:
    batch: dict          # the host batch (input_ids, attention_mask, labels, ...)
    epoch: int           # the data position after it
    batches_in_epoch: int


class StepBatches:
    """Micro-batches from the data position (epoch, batches_in_epoch) on, `take(n)` at a time.

    `make_loader(epoch, skip_batches)` builds one epoch's loader; `after_first_iter` runs once,
    right after the first loader's `iter()` (a resumed run restores its RNG state there: iter()
    draws a seed)."""

    def __init__(self, make_loader: Callable, epoch: int, batches_in_epoch: int,
                 after_first_iter: Callable | None = None):
        self.make_loader = make_loader
        self.epoch, self.batches_in_epoch = epoch, batches_in_epoch
        self.after_first_iter = after_first_iter
        self._batches: Iterator[dict] | None = None
        self._yielded = False        # whether the open loader gave a micro-batch
        self._empty_epochs = 0

    def take(self, n: int) -> list[MicroBatch]:
        """The next `n` micro-batches (an optimizer step's), opening the next epochs as needed."""
        out: list[MicroBatch] = []
        while len(out) < n:
            if self._batches is None:
                self._batches = iter(self.make_loader(self.epoch, self.batches_in_epoch))
                self._yielded = False
                if self.after_first_iter is not None:
                    self.after_first_iter()
                    self.after_first_iter = None
            batch = next(self._batches, None)
            if batch is None:   # this epoch is used up: the next one, reshuffled
                self._empty_epochs = 0 if self._yielded else self._empty_epochs + 1
                if self._empty_epochs > 1:
                    raise RunFailure("the training data yields no batches on this rank: an epoch "
                                     "trains whole global batches, so it needs at least "
                                     "training.global_batch_size samples (micro_batch_size x ranks "
                                     "x accumulation); check the data files")
                self.epoch, self.batches_in_epoch, self._batches = self.epoch + 1, 0, None
                continue
            self._yielded = True
            self.batches_in_epoch += 1
            out.append(MicroBatch(batch, self.epoch, self.batches_in_epoch))
        return out
