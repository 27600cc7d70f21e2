"""The DeepSpeed ops a job loads, found by compiling it as `jobspec launch` would (`jobspec prepare`)."""
from __future__ import annotations


def job_ops(job: str, overrides: list[str]) -> list[str]:
    """The op builders the compiled job loads: validate, memory decisions at launch, compile."""
    from jobspec import hardware, ops
    from jobspec.compile.compiler import compile_spec
    from jobspec.memory import at_launch
    from jobspec.model.trace import job_profiler
    from jobspec.spec.inputs import derive_job
    from jobspec.spec.validation import load_and_validate

    resolved = load_and_validate(job, overrides)
    # `memory.fit: auto` may switch to optimizer offload (CPU Adam): decide as the launch will
    gpu_free = hardware.gpu_free_bytes(resolved.spec["resources"]["gpus_per_node"])
    resolved, derived, _ = at_launch.prepare(resolved, derive_job(resolved.spec, profiler=job_profiler()), gpu_free,
                                             bf16_supported=hardware.bf16_supported())
    compiled = compile_spec(resolved.spec, derived, run_dir="RUN_DIR")
    return ops.needed_ops(compiled.ds_config)
