"""`masked-lm`: predict masked tokens (BERT-style pre-training).

Head AutoModelForMaskedLM; labels the ids of 15% of the tokens (80% masked, 10% random, 10% kept;
fixed per seed), -100 elsewhere; needs a tokenizer with a mask token; loss the head's cross-entropy
over the masked positions; metric perplexity (exp of the mean loss per predicted token).
"""
from jobspec.tasks.base import MASKED_TOKENS, TOKEN_LOSS, Task

TASK = Task(
    name="masked-lm",
    auto_class="AutoModelForMaskedLM",
    labels=MASKED_TOKENS,
    counts=TOKEN_LOSS,
    metrics=("loss", "perplexity"),
    loss="cross-entropy over the masked tokens",
)
