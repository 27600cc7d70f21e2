"""The DeepSpeed ops a job loads, found by compiling it as `jobspec launch` would (`jobspec
prepare`)."""
from __future__ import annotations


def job_ops(job: str, overrides: list[str]) -> list[str]:
    """The op builders the compiled job loads: the job prepared as the launch prepares it (validate,
    memory decisions on this host: `memory.fit: auto` may switch to optimizer offload, CPU Adam;
    compile)."""
    from jobspec import ops
    from jobspec.job.prepare import Preparation, prepare_job

    compiled = prepare_job(job, overrides, how=Preparation(plan=True)).compiled
    assert compiled is not None   # compiled for the default run directory
    return ops.needed_ops(compiled.ds_config)
