#!/bin/bash
#SBATCH --job-name=jobspec
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#
# Run a jobspec job, on a workstation or as a Slurm batch job:
#
#   ./launch.sh jobs/quickstart.yaml [--set KEY=VALUE ...] [other `jobspec launch` flags]
#   sbatch launch.sh jobs/quickstart.yaml --set training.max_steps=1000
#   sbatch --nodes=2 --time=04:00:00 launch.sh jobs/big.yaml --set resources.nodes=2
#
# The #SBATCH lines above are defaults; sbatch's command-line flags override them, and
# `jobspec sbatch JOB` renders a script with the spec's own resources that calls this file.
#
# Environment: JOBSPEC_VENV=DIR activates DIR/bin/activate first (the venv jobspec is installed in).
#
# Preemption: Slurm sends SIGUSR1 to this shell (`--signal=B:USR1@N`: N seconds before the time
# limit, or `scancel --signal=USR1 -b JOB`). It is forwarded to `jobspec launch`, which forwards it to
# the ranks; they checkpoint at the next step boundary and stop with status "preempted", and jobspec
# exits 75 (EX_TEMPFAIL: stopped with a checkpoint, the same command resumes it). This script then
# runs `scontrol requeue $SLURM_JOB_ID`; the requeued job starts this script again and
# `checkpoint.resume: auto` continues from the checkpoint (same MLflow run).
#
# Why jobspec runs as a child plus `wait`, not `exec`: bash runs a trap only between commands, and
# not at all once exec'd away, so the signal must arrive while bash sits in `wait` (which a trapped
# signal interrupts). The loop below re-waits until jobspec has really exited.
set -euo pipefail

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '/^# Run a jobspec job/,/^# Environment/p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi

if [ -n "${JOBSPEC_VENV:-}" ]; then
  set +u  # some activate scripts read unset variables
  # shellcheck disable=SC1091
  source "$JOBSPEC_VENV/bin/activate"
  set -u
fi

in_slurm=0
if [ -n "${SLURM_JOB_ID:-}" ]; then
  in_slurm=1
  cd "${SLURM_SUBMIT_DIR:-.}"  # relative spec paths, runs/ and mlflow.db are where the job was submitted
  echo "launch.sh: Slurm job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}," \
       "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >&2
fi

if command -v jobspec >/dev/null 2>&1; then
  jobspec_cmd=(jobspec)
else
  jobspec_cmd=(python3 -m jobspec)
fi

child=""
preempted=0

on_usr1() {
  preempted=1
  echo "launch.sh: SIGUSR1 (time limit or preemption): asking jobspec to checkpoint and stop" >&2
  if [ -n "$child" ]; then kill -USR1 "$child" 2>/dev/null || true; fi
}

on_term() {
  # Inside Slurm every process of the job already got the SIGTERM (`scancel`): just keep waiting
  # for jobspec's checkpoint. Outside Slurm, pass it on (a repeat is harmless: jobspec keeps waiting
  # for the checkpoint; only a second SIGINT, a second Ctrl-C, ends the job at once).
  if [ "$in_slurm" = 0 ] && [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; fi
}

trap on_usr1 USR1
trap on_term TERM
trap ':' INT  # Ctrl-C reaches jobspec directly (same process group); keep waiting for its checkpoint

"${jobspec_cmd[@]}" launch "$@" &
child=$!
if [ "$preempted" = 1 ]; then kill -USR1 "$child" 2>/dev/null || true; fi  # arrived before the fork

status=0
while :; do
  wait "$child" && status=0 || status=$?
  # `wait` also returns (status > 128) when a trapped signal interrupts it: is jobspec still there?
  kill -0 "$child" 2>/dev/null || break
done

if [ "$preempted" = 1 ] && [ "$in_slurm" = 1 ]; then
  # 75: jobspec checkpointed and stopped; 138 (128+USR1): it died of the signal before it could
  # handle it, so nothing is lost by starting over. 0 (it finished anyway) and any failure are not
  # requeued (no loops).
  if [ "$status" = 75 ] || [ "$status" = 138 ]; then
    echo "launch.sh: requeueing Slurm job ${SLURM_JOB_ID}" >&2
    scontrol requeue "$SLURM_JOB_ID" || echo "launch.sh: scontrol requeue failed (job not requeueable?)" >&2
    status=0
  fi
fi
exit "$status"
