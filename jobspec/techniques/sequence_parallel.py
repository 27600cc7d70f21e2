"""`memory.sequence_parallel`: DeepSpeed Ulysses, N ranks sharing each sequence (the ranks' groups:
train/sequence_parallel.py; ds_config's `sequence_parallel_size`: compile/compiler; the exchange
buffers the plan adds: memory/ulysses_buffers). Its rules: spec/rules/sequence_parallel.py."""
from __future__ import annotations

from jobspec.spec.rules import sequence_parallel as sequence_parallel_rules
from jobspec.techniques.base import Technique

TECHNIQUE = Technique(
    name="sequence_parallel", summary="Ulysses: N ranks share each sequence, attention by heads",
    rules=(sequence_parallel_rules.sequence_parallel_issues,))
