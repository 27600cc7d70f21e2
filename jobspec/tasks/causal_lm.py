"""`causal-lm`: predict the next token (GPT-style).

Head AutoModelForCausalLM; labels the input ids (-100 on padding), which the model shifts by one;
loss the head's cross-entropy of each next token; metric perplexity (exp of the mean loss per
predicted token: every labelled token but the first of each sequence).
"""
from jobspec.tasks.base import NEXT_TOKENS, TOKEN_LOSS, Task

TASK = Task(
    name="causal-lm",
    auto_class="AutoModelForCausalLM",
    labels=NEXT_TOKENS,
    counts=TOKEN_LOSS,
    metrics=("loss", "perplexity"),
    loss="cross-entropy of the next token",
    shift=1,
)
