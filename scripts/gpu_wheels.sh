#!/usr/bin/env bash
# Wheels for a lent GPU machine that cannot reach PyPI (its image has torch, transformers and peft,
# not DeepSpeed, datasets, jsonschema or bitsandbytes): downloaded here for its Python (3.12) into
# .whl/ (git-ignored), carried with the working tree (64 MiB in all), installed there by
# scripts/gpu_session.sh. MLflow is left out (too big to carry): the GPU jobs run with
# logging.mlflow.enabled=false, a path that never imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${GPU_PYTHON_VERSION:-3.12}"
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_28_x86_64 --platform any)
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8   # pure Python: ops JIT-built there
python -m pip download -q --no-deps -d .whl --python-version "$py" "${plat[@]}" --only-binary=:all: \
  bitsandbytes==0.50.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash fsspec==2026.9.0 \
  jsonschema jsonschema-specifications referencing rpds-py attrs \
  hjson msgpack ninja einops py-cpuinfo nvidia-ml-py pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
# model.kernels: liger (the image's CUDA torch brings Triton)
python -m pip download -q --no-deps -d .whl --python-version "$py" "${plat[@]}" --only-binary=:all: liger-kernel==0.8.5
du -sh .whl
