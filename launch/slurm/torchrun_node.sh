#!/usr/bin/env bash
# One torchrun per node: the task that the sbatch templates in this directory start with
# `srun --ntasks-per-node=1`; torchrun then starts NPROC_PER_NODE training ranks on its node.
#   srun ... launch/slurm/torchrun_node.sh --config configs/X.yaml [section.key=value ...]
# Environment (exported by common.sh):
#   NPROC_PER_NODE   training processes on this node (one per GPU)
#   RDZV_ENDPOINT    host:port of the c10d rendezvous on the job's first node (multi-node only)
#   RDZV_CONF        extra c10d rendezvous options, comma separated (multi-node only)
#   ELASTIC_MIN_NODES go on without lost nodes down to this many (multi-node only); MAX_RESTARTS (default 3)
#   SPARE_NODES      this many of the step's nodes wait as hot spares (multi-node only)
#   PYTHON           interpreter with torch and this project's requirements (default python3)
set -euo pipefail

: "${NPROC_PER_NODE:?NPROC_PER_NODE must be set (training processes per node)}"
python=${PYTHON:-python3}
# The step's node count, not the job's: a step may use fewer nodes than were allocated.
nnodes=${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-1}}

restarts=0
if ((nnodes == 1)); then
    # A free port on this node: several single-node jobs can share a machine.
    rdzv=(--standalone)
else
    : "${RDZV_ENDPOINT:?RDZV_ENDPOINT must be set for a multi-node step (see common.sh)}"
    # The first node hosts the rendezvous store. Said explicitly rather than left to torchrun's
    # hostname matching, which misfires when the endpoint is an address of another interface
    # (or, on a test cluster of several slurmd on one machine, matches on every "node").
    is_host=0
    [[ ${SLURM_NODEID:-0} == 0 ]] && is_host=1
    # Hot spares: the rendezvous admits at most the training nodes; the agents of the others wait in torchrun's
    # redundancy list, and one of them takes a lost node's place at the next round (same world, same DP)
    spares=${SPARE_NODES:-0}
    training=$((nnodes - spares))
    nodes="$training:$training"
    if [[ -n ${ELASTIC_MIN_NODES:-} ]]; then
        # torchrun's agent restarts the workers without a lost node (or with a joining one); recipes.launch checks
        # the recipe for every node count first
        nodes="$ELASTIC_MIN_NODES:$training"
    fi
    if [[ -n ${ELASTIC_MIN_NODES:-} ]] || ((spares > 0)); then
        restarts=${MAX_RESTARTS:-3}
    fi
    rdzv=(--nnodes "$nodes" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
          --rdzv-id "${SLURM_JOB_ID:-local}-${SLURM_RESTART_COUNT:-0}"
          --rdzv-conf "is_host=$is_host${RDZV_CONF:+,$RDZV_CONF}")
fi

# Several ranks share each node's cores: an OpenMP pool per rank would oversubscribe them (GPU
# ranks do not need one; a CPU rehearsal would crawl).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The batch script reads the log while training runs (progress, the clean-stop line).
export PYTHONUNBUFFERED=1

# Signals. SLURM delivers a step signal (scancel --signal, preemption's SIGTERM) to every process
# of the step: this torchrun, all its ranks and their helpers (megatron_ext/checkpoint/save_load.py
# starts megatron-core's checkpoint-writer helpers with both signals ignored). The ranks
# checkpoint on SIGUSR1/SIGTERM at the next step boundary and exit 0. torchrun must stay out of
# the way:
# - SIGUSR1's default action would kill torchrun (and with it the job step): ignore it.
# - On SIGTERM torchrun would re-send it, SIGKILL its ranks 30 s later (cutting a large
#   checkpoint short) and exit 1; leave SIGTERM out of the signals it handles (PET_* is how
#   torchrun's options read the environment; honoured by torch >= 2.9, older torchruns keep
#   their 30 s limit) and ignore it. SLURM's own SIGKILL after KillWait/GraceTime still applies.
# Ignored dispositions are inherited through exec; the ranks install their own handlers when
# training starts (megatron_ext/training/trainer.py), so a signal that arrives while they are still
# starting up is dropped rather than fatal.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGINT,SIGHUP,SIGQUIT}
trap '' USR1 TERM

# recipes.launch is torchrun's agent plus a config check before any rank starts and a one-line summary of a
# failed run; its exit code is the failed rank's (4: the hang watchdog ended the job, which common.sh requeues).
exec "$python" -m recipes.launch "${rdzv[@]}" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$restarts" "$@"
