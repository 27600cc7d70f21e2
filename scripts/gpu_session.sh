#!/usr/bin/env bash
# One lent-GPU session, run from the repository root on the device (the `device` tool's run), with
# .whl/ from scripts/gpu_wheels.sh carried along:
#
#   scripts/gpu_session.sh [STEP...]     # steps: probe qlora packing zero3 suite (default: all, in order)
#   scripts/gpu_session.sh probe calibrate  # the planner's calibration (6 min: a session of its own)
#   scripts/gpu_session.sh startup          # time to the first step of 3 jobs (5 min: a session of its own)
#   scripts/gpu_session.sh probe throughput # tokens/s, MFU, model.compile on and off (6 min, alone)
#
# Installs the carried wheels (only what the image lacks: pip resolves against what is there), then
# runs each step under its own time limit, writing its output to $OUT/<step>.txt (or /tmp/gpu-out).
# A step that fails or runs out of time is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=python3

install() {
  "$py" -m pip install -q --no-index --find-links .whl --break-system-packages --no-warn-script-location \
    deepspeed datasets jsonschema bitsandbytes nvidia-ml-py py-cpuinfo liger-kernel 2>&1 | tail -n 5
}

step() {  # step NAME LIMIT_S COMMAND...
  local name="$1" limit="$2"; shift 2
  local t0; t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t0 ))s"; tail -n 25 "$out/$name.txt"
}

steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(probe qlora packing zero3 suite)
install
for s in "${steps[@]}"; do
  case "$s" in
    probe)   step probe 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c 'import torch, transformers, deepspeed, datasets, peft, bitsandbytes, pyarrow; print(*(f\"{m.__name__} {m.__version__}\" for m in (torch, transformers, deepspeed, datasets, peft, bitsandbytes, pyarrow)))'; nproc; free -g" ;;
    packing) step packing 170 "$py" -m bench packing --gpu --work "$out/packing-work" ;;
    qlora)   step qlora 200 "$py" -m bench qlora-gpu --work "$out/qlora-work" ;;
    # the 8B plan needs ~121 GiB of host RAM per rank (CPU Adam's fp32 states): on a smaller host the
    # script stops before starting (exit 2) and the same job with fewer layers runs instead
    zero3)   step zero3 200 bash -c "$py -m bench.zero3_offload_gpu --out $out/zero3.md; rc=\$?; [ \$rc = 2 ] && $py -m bench.zero3_offload_gpu --layers 20 --out $out/zero3-20layers.md || exit \$rc" ;;
    suite)   step suite 420 "$py" -m bench gpu --out "$out/gpu-suite.md" ;;
    # no job starts after 330 s; the file is written after every job (peaks/ beside it: the breakdowns);
    # the run dirs stay in /tmp ($OUT brings back only a few files)
    calibrate) step calibrate 420 "$py" -m bench gpu-calibrate --out "$out/calibration.json" --work /tmp/calibrate-work ;;
    # no job runs past 285 s (bench/gpu_startup.py's budget); startup.md and startup.json come back
    startup) step startup 300 "$py" -m bench gpu-startup --out "$out/startup.md" --work /tmp/startup-work ;;
    # no run starts unless its estimate ends it by 330 s; the table and its JSON (calibration-file
    # shape: matmul, throughput) come back, the run dirs stay in /tmp
    throughput) step throughput 390 "$py" -m bench gpu-throughput --out "$out/gpu-throughput.md" \
                  --work /tmp/throughput-work ;;
    *) echo "unknown step $s (probe packing qlora zero3 suite calibrate startup throughput)"; exit 2 ;;
  esac
done
