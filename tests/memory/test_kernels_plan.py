"""`jobspec plan` of a `model.kernels: liger` job (memory/planner.py): the header names the kernels,
a note says what the trace measured, and the traced rows show the difference the fused kernels make
(less kept in the layers, the fused loss's gradients and one chunk of logits in place of the
logits),
from the trace of Liger's kernels' stand-ins (model/kernel_stand_ins.py)."""
from __future__ import annotations

import re

import yaml

from jobspec.cli import main
from jobspec.techniques.fused_kernels import REFERENCE_ENV

JOB = {"model": {"architecture": "llama", "task": "causal-lm",
                 "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 8000,
                            "max_position_embeddings": 1024}},
       "data": {"synthetic": {"num_samples": 16, "seq_len": 256, "vocab_range": [5, 8000]}},
       "training": {"max_steps": 2, "micro_batch_size": 2},
       "memory": {"precision": "bf16"},
       "logging": {"mlflow": {"enabled": False}}}
UNITS = {"MiB": 2 ** 20, "GiB": 2 ** 30}


def rows(text: str) -> dict[str, float]:
    """The plan table's rows, in bytes."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^  (\S.*?)\s{2,}([0-9.]+) (MiB|GiB)$", line)
        if match:
            found[match.group(1)] = float(match.group(2)) * UNITS[match.group(3)]
    return found


def test_plan_shows_what_the_kernels_keep(tmp_path, capsys, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB, sort_keys=False))
    monkeypatch.setenv(REFERENCE_ENV, "1")   # this CPU host: validation accepts the kernels
    assert main(["plan", str(job)]) == 0
    plain = capsys.readouterr().out
    assert main(["plan", str(job), "--set", "model.kernels=liger"]) == 0
    fused = capsys.readouterr().out
    assert "kernels liger" in fused.splitlines()[1] and "kernels" not in plain.splitlines()[1]
    assert "note: model.kernels: liger: the activations are what Liger's kernels keep" in fused
    assert "fused linear cross-entropy" in fused and "model.kernels" not in plain
    before, after = rows(plain), rows(fused)
    assert after["layer activations (traced)"] < before["layer activations (traced)"]
    # the logits of 2 x 256 tokens over 8000 entries, in bf16, are more than the fused loss holds
    # (the head weight's gradient, 8000 x 64 in bf16, and one chunk of logits)
    head = "head, logits and loss (traced)"
    assert before[head] > 2 * 256 * 8000 * 2 > after[head] > 8000 * 64 * 2
    assert after["peak allocated"] < before["peak allocated"]
    for same in ("parameters (working copy)", "optimizer states"):
        assert after[same] == before[same]
