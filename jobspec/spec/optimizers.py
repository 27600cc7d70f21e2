"""The optimizers a spec can name (`training.optimizer.name`), by who builds them."""
from __future__ import annotations

# DeepSpeed builds these itself from the ds_config `optimizer` block.
DEEPSPEED_OPTIMIZERS = ("adamw", "sgd")
# The worker builds these (a `client_optimizer` patch) and DeepSpeed wraps them; DeepSpeed's CPU Adam
# is not among them, so they cannot be offloaded.
CLIENT_OPTIMIZERS = ("adamw_8bit", "adafactor")
