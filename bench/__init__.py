"""Benchmarks: `python -m bench` (jobspec vs the HF Trainer), planner accuracy, spec speed."""
