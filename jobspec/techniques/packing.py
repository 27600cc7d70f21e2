"""`data.packing`: short samples packed into full-length rows, position ids restarting per sample
(data/sample_packing.py on the ranks). Its rules: spec/rules/packing.py."""
from __future__ import annotations

from jobspec.spec.rules import packing as packing_rules
from jobspec.techniques.base import Technique

TECHNIQUE = Technique(
    name="packing", summary="short samples packed into full rows, kept apart by their position ids",
    rules=(packing_rules.packing_issues,))
