"""`zero_optimization.sub_group_size: 0` (Axolotl's published ZeRO-3 configs) is accepted with DeepSpeed's
meaning, one optimizer sub-group per parameter, and planned with it (issue 36 item 7)."""
from __future__ import annotations

import pytest

from conftest import REPO_ROOT
from jobspec.cli import main
from jobspec.memory.host_ram import stage3_sub_groups


class _Param:
    def __init__(self, numel: int):
        self.numel = numel

    def partition_numel(self) -> int:
        return self.numel


@pytest.mark.parametrize("size", [0, 1, 4, 7, 10**9])
def test_sub_groups_are_deepspeeds(size):
    """The planner's sub-groups against DeepSpeed's own `_create_fp16_sub_groups` on the same sizes."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    numels = [3, 5, 2, 8, 1]
    params = [_Param(n) for n in numels]
    fake = type("Optimizer", (), {"sub_group_size": size})()
    theirs = [sum(p.numel for p in group) for group in
              DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(fake, params)]
    assert stage3_sub_groups(numels, size) == theirs
    if size == 0:
        assert theirs == numels   # 0: every parameter its own sub-group


def test_sub_group_size_zero_validates_compiles_and_plans(capsys):
    job = str(REPO_ROOT / "jobs" / "llama-70b-zero3.yaml")
    setting = "memory.zero.sub_group_size=0"
    assert main(["validate", job, "--set", setting]) == 0
    assert main(["compile", job, "--set", setting, "--format", "json"]) == 0
    assert '"sub_group_size": 0' in capsys.readouterr().out
    assert main(["plan", job, "--set", setting, "--set", "model.config.num_hidden_layers=2"]) in (0, 1)
    out = capsys.readouterr()
    assert "predicted memory per rank" in out.out and "Traceback" not in out.err
