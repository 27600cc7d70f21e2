"""The planner's model states against the tensors a real DeepSpeed engine holds (2 CPU ranks, ZeRO 0-3).

tests/assets/engine_memory.py runs one step of each stage's engine, one after another in one launch of the
real `deepspeed --num_gpus 2` runner (one start-up instead of four), and dumps per-rank bytes of parameters,
gradients, fp32 master copies and optimizer states; the planner's parameters + gradients + master weights +
optimizer states must match the worst rank within 2%.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import PROFILER, REPO_ROOT, free_port
from jobspec.compile.compiler import compile_spec
from jobspec.shm import remove_shared_memory_buffers
from jobspec.spec.derived import derive
from jobspec.memory.planner import plan_memory
from jobspec.spec.schema import fill_defaults

SCRIPT = REPO_ROOT / "tests" / "assets" / "engine_memory.py"
STAGES = (0, 1, 2, 3)
ABORT_SIGNATURE = "terminate called without an active exception"

# Wide enough that buckets and the tensors straddling a ZeRO partition edge stay small next to Ψ/2.
ENGINE_SPEC = {
    "name": "engine-memory",
    "model": {"architecture": "bert", "task": "sequence-classification", "num_labels": 2,
              "config": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
                         "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 64}},
    "data": {"synthetic": {"num_samples": 64, "seq_len": 16}},
    "training": {"max_steps": 2, "micro_batch_size": 2, "optimizer": {"lr": 1e-3}},
    "resources": {"gpus_per_node": 2},
}


def _run_stages(root: Path, stages: tuple[int, ...]) -> dict[int, tuple[dict, list[dict]]]:
    specs, run_dirs = {}, []
    for stage in stages:   # ascending: ZeRO-3 (its partitioned parameters, its hooks) is measured last
        run_dir = root / f"zero{stage}"
        run_dir.mkdir()
        spec = fill_defaults({**ENGINE_SPEC, "memory": {"zero_stage": stage}})
        compiled = compile_spec(spec, derive(spec))
        (run_dir / "resolved.yaml").write_text(yaml.safe_dump(spec))
        (run_dir / "ds_config.json").write_text(json.dumps(compiled.ds_config))
        specs[stage] = spec
        run_dirs += ["--run-dir", str(run_dir)]
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    for attempt in (1, 2):
        port = free_port()
        try:
            proc = subprocess.run([deepspeed, "--num_gpus", "2", "--master_port", str(port), str(SCRIPT),
                                   *run_dirs], cwd=root, capture_output=True, text=True, timeout=900)
        finally:  # DeepSpeed never unlinks its 2 x 66 MB all-reduce buffers; nothing maps them now
            remove_shared_memory_buffers(port)
        # Once in CI (fresh venv, two 2-rank runs on 2 cores) a ZeRO-3 rank died in C++ mid-step,
        # "terminate called without an active exception", no Python traceback; it never reproduced
        # here in 5 runs. That abort is DeepSpeed's CPU backend, not what this test measures: one
        # more try, for that signature only; anything else fails at once.
        if proc.returncode == 0 or attempt == 2 or ABORT_SIGNATURE not in proc.stderr:
            break
        print(f"rank aborted ({ABORT_SIGNATURE!r}); running it once more", file=sys.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {stage: (specs[stage], [json.loads((root / f"zero{stage}" / f"memory-rank{r}.json").read_text())
                                   for r in (0, 1)]) for stage in stages}


@pytest.fixture(scope="module")
def engine_dumps(tmp_path_factory):
    return _run_stages(tmp_path_factory.mktemp("engine-memory"), STAGES)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_model_states_match_the_engine(engine_dumps, stage):
    spec, ranks = engine_dumps[stage]
    plan = plan_memory(spec, derive(spec, profiler=PROFILER))
    assert ranks[0]["num_parameters"] == plan.settings["parameters"]   # same model on both sides
    measured = max(sum(v for k, v in r["bytes"].items() if k in plan.breakdown) for r in ranks)
    # A model against the engine's tensors, not arithmetic. What the planner leaves out: ZeRO's alignment
    # padding of the flat groups (stages 1-2: < 2 x world elements per group; stage 3: < world elements per
    # parameter, < 100 parameters here), under 2 KB of the 2-4 MB per rank (< 0.1 %). 2 % (unchanged: this
    # slow test could not be re-run here to measure the gap) is 20x that. A term left out is >= 1/8 of the
    # states (16-bit gradients 2 of 16 bytes per parameter at bf16, 4 of 16 at fp32); a straddling
    # parameter mis-counted is up to the 1000 x 64 embedding, 256 KB = 6 %: both outside
    assert plan.model_states == pytest.approx(measured, rel=0.02), \
        f"ZeRO-{stage}: planner {plan.breakdown} vs engine {[r['bytes'] for r in ranks]}"
