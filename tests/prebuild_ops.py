"""Build DeepSpeed's JIT ops once, up front (run by tests/conftest.py in the background).

A fresh machine builds them on first use, minutes each (cpu_adam ~1.5 min, async_io longer); started
at the beginning of the session, the builds overlap the fast tests instead of stalling the first
launch of a slow test past its timeout. torch's extension lock makes a launch that needs an op
while it is being built wait for it instead of building it twice.
"""
import sys

OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    failed = []
    for name in OPS:
        try:
            builder = accelerator.create_op_builder(name)
            if builder is not None and builder.is_compatible(verbose=False):
                builder.load(verbose=False)
        except Exception as err:  # a missing op shows up again, with its reason, in the test that needs it
            failed.append(f"{name}: {err}")
    for line in failed:
        print(f"prebuild_ops: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
