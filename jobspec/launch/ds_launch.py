"""DeepSpeed's per-node launcher (`deepspeed.launcher.launch`), run unchanged as `__main__`, with
DeepSpeed imported through `jobspec.ops.import_deepspeed`: launch.py itself only spawns and watches
the ranks, yet its `import deepspeed` imports MLflow (DeepSpeed's autotuner), ~1.7 s of CPU before
any rank starts. `python -u -m jobspec.launch.ds_launch ARGS` takes exactly launch.py's arguments
(jobspec/launch/runner.py builds them as DeepSpeed's runner would)."""
from __future__ import annotations

import runpy

from jobspec.ops import import_deepspeed

if __name__ == "__main__":
    import_deepspeed()
    runpy.run_module("deepspeed.launcher.launch", run_name="__main__", alter_sys=True)
