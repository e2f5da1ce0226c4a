# shellcheck shell=bash
# The body shared by the sbatch templates in this directory; sourced by them, not run.
# `slurm_pretrain [section.key=value ...]` runs one recipe as one job step (one torchrun per node)
# and makes the job survive its time limit or a pre-emption warning: see "Signals and requeue"
# below and docs/slurm.md.
#
# Knobs, all environment variables (sbatch exports the submitting shell's environment):
#   CONFIG            recipe YAML, relative to the repository (each template sets a default)
#   OVERRIDES         extra section.key=value overrides, space separated (after the template's)
#   NPROC_PER_NODE    training processes per node; default: the GPUs SLURM gave the node
#   RUN_DIR           where this run's checkpoints, TensorBoard events and logs go; default
#                     runs/<job name>-<job id>, which a requeued job keeps (same id). It
#                     outlives the job: a new job given the same RUN_DIR resumes from it.
#   CHECKPOINT_DIR    default $RUN_DIR/checkpoints (checkpoint.save, which a run resumes from)
#   TENSORBOARD_DIR   default $RUN_DIR/tensorboard
#                     (per-rank tracebacks and hang stacks go to $RUN_DIR/logs/rank-N.log)
#   CONTAINER_IMAGE   run the step in this image with pyxis/enroot (srun --container-image)
#   CONTAINER_MOUNTS  extra mounts, comma separated src:dst (the repository, and RUN_DIR, CHECKPOINT_DIR and
#                     TENSORBOARD_DIR where they lie outside it, are always mounted at their own paths, so paths
#                     are the same inside and outside the container and checkpoints land on the shared file system)
#   RDZV_HOST         multi-node: address of the first node for the rendezvous; default its
#                     NodeAddr in slurm.conf (usually its hostname)
#   RDZV_PORT         multi-node: rendezvous port; default 20000 + job id % 20000
#   REQUEUE_ON_SIGNAL 1 (default): requeue the job after a clean stop on SIGUSR1; 0: just stop
#   REQUEUE_ON_HANG   1 (default): requeue the job when the hang watchdog ended it (train.hang_timeout_s)
#   REQUEUE_ON_FAILURE 1 (default): requeue the job when a rank crashed, was killed, lost its peers (NCCL error,
#                     lost node) or the step failed otherwise; never after exit 2 (config, data, checkpoint: a
#                     requeue would fail the same way), 3 (divergence: needs a person) or 6 (disk full or
#                     permission denied: not the node's fault, and excluding it would not help)
#   MAX_REQUEUES      3 (default): at most this many hang/failure requeues per job (signal requeues are planned
#                     and not counted); then the job ends failed
#   EXCLUDE_FAILED_NODES 1 (default): a failure requeue leaves out the node(s) whose rank failed first, and those
#                     that left the job after a fault recurred on their GPU
#   ELASTIC_MIN_NODES multi-node: go on without a lost node, down to this many nodes (torchrun --nnodes MIN:N; DP
#                     follows the world, docs/slurm.md "Elastic"); submit with `sbatch --no-kill` so that SLURM
#                     keeps the allocation when a node fails. Unset (default): a lost node ends the job step and
#                     the job is requeued
#   SPARE_NODES       multi-node: this many of the job's nodes wait as hot spares (torchrun's redundancy list); a lost
#                     node is replaced by one at the next rendezvous, the world, DP and global batch unchanged, so
#                     the run goes on exactly (docs/slurm.md "Hot spares"). With ELASTIC_MIN_NODES the job shrinks
#                     once no spare is left. Submit with `sbatch --no-kill`; default 0
#   MAX_RESTARTS      with ELASTIC_MIN_NODES or SPARE_NODES: worker restarts torchrun's agents may make (default 3)
#   RDZV_CONF         extra c10d rendezvous options, comma separated (e.g. last_call_timeout=5,keep_alive_interval=2)
#   PYTHON            interpreter; default python in a container, else .venv/bin/python if
#                     present, else python3

# Signals and requeue:
# - SIGUSR1 to this batch script (`#SBATCH --signal=B:USR1@600` before the time limit, or
#   `scancel --batch --signal=USR1 JOBID` by hand) means "checkpoint, stop and come back": the
#   trap passes SIGUSR1 on to every process of the job step, the ranks agree to stop at the
#   next logging step, checkpoint and exit 0, and the script requeues the job, which resumes
#   from CHECKPOINT_DIR (checkpoint.load is auto: the run resumes from its checkpoint.save).
# - SIGTERM (scancel, or pre-emption with a GraceTime) reaches every process of the job at
#   once: the ranks checkpoint and stop the same way, but the script does not requeue (a
#   cancelled job stays cancelled; a pre-empted one is requeued by SLURM itself when the
#   cluster's PreemptMode says so).
# Whether the run stopped early on a signal, finished, or which node's rank failed is read from the records rank 0
# and each node's launcher write in $RUN_DIR/logs/run-result/ (megatron_ext/resilience/run_record.py), not from
# console text: a clean stop exits 0, as a finished run does. A hang or failure is read from the exit code, which
# recipes.launch passes on (docs/slurm.md has the whole table).

# megatron_ext/errors.py's exit codes (srun passes on the launcher's).
# shellcheck source=launch/exit_codes.sh
source launch/exit_codes.sh

# The --container-mounts of a step: the repository and each of the given directories outside it at their own paths
# (a checkpoint directory on Lustre, say, which the container would otherwise hide: the checkpoints would land in
# the container's own file system and vanish with it), then CONTAINER_MOUNTS.
_container_mounts() {
    local mounts="$PWD:$PWD" dir
    for dir in "$@"; do
        dir=$(mkdir -p "$dir" && cd "$dir" && pwd)
        [[ $dir == "$PWD" || $dir == "$PWD"/* ]] || mounts+=",$dir:$dir"
    done
    [[ -n ${CONTAINER_MOUNTS:-} ]] && mounts+=",$CONTAINER_MOUNTS"
    echo "$mounts"
}

_log() { echo "[$(date +%H:%M:%S) slurm job ${SLURM_JOB_ID:-?}] $*"; }

_term_seen=0
_forwarded=0

_on_signal() {
    if [[ $1 == TERM ]]; then
        # SLURM sends a job's SIGTERM to the job steps as well: the ranks already have it.
        _term_seen=1
        _log "got SIGTERM: the training ranks checkpoint and stop at the next logging step"
        return
    fi
    _log "got SIGUSR1: asking the training ranks to checkpoint and stop at the next logging step"
    # Once: the ranks need only one, and a repeat is just noise in the logs.
    if ((_forwarded == 0)); then
        _forwarded=1
        # Without --batch/--full, scancel signals every job step and not this script.
        scancel --signal=USR1 "$SLURM_JOB_ID" || _log "warning: could not signal the job steps"
    fi
}

# The c10d rendezvous address of the job's first node.
_rdzv_host() {
    if [[ -n ${RDZV_HOST:-} ]]; then
        echo "$RDZV_HOST"
        return
    fi
    local first addr
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    addr=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)
    echo "${addr:-$first}"
}

# Requeue this job, without the nodes in $1 (comma separated; may be empty). requeuehold, then the exclusion (SLURM
# refuses it for a running job), then release: SLURM ends this script meanwhile, so TERM is ignored until done.
_requeue() {
    local exclude=$1
    trap '' TERM
    if ! scontrol requeuehold "$SLURM_JOB_ID"; then
        _log "error: requeue refused; resubmit with the same RUN_DIR to resume"
        return 1
    fi
    if [[ -n $exclude ]]; then
        local before
        before=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/.*ExcNodeList=\([^ ]*\).*/\1/p' | head -n 1)
        [[ -n $before && $before != "(null)" ]] && exclude="$before,$exclude"
        scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$exclude" ||
            _log "warning: could not exclude $exclude; the next attempt may land there again"
    fi
    scontrol release "$SLURM_JOB_ID"
}

# After a hang or a failure: requeue unless MAX_REQUEUES such requeues of this job already happened.
_requeue_after_failure() {
    local what=$1 exclude=$2 counter="$run_dir/logs/failure-requeues-$SLURM_JOB_ID" count=0
    [[ -f $counter ]] && count=$(<"$counter")
    if ((count >= ${MAX_REQUEUES:-3})); then
        _log "$what; not requeueing: MAX_REQUEUES=${MAX_REQUEUES:-3} requeues after failures already happened" \
             "($counter). Fix the cause, then resubmit with RUN_DIR=$run_dir to resume"
        return 1
    fi
    echo $((count + 1)) >"$counter"
    [[ ${EXCLUDE_FAILED_NODES:-1} == 1 ]] || exclude=""
    _log "$what; requeueing (failure requeue $((count + 1)) of ${MAX_REQUEUES:-3})${exclude:+ without $exclude}:" \
         "the next attempt resumes from $ckpt_dir"
    _requeue "$exclude"
}

# The run's verdict as shell assignments (ENDED, ITERATION, FAILED_NODES, SUSPECT_NODES), read by a standard-library module: the
# host's python3 when the ranks run in a container. Empty values when no record could be read.
_run_record() {
    local py=$PYTHON
    [[ -n ${CONTAINER_IMAGE:-} ]] && py=python3
    "$py" -m megatron_ext.resilience.run_record "$1" 2>/dev/null ||
        echo 'ENDED="" ITERATION="" FAILED_NODES="" SUSPECT_NODES=""'
}

slurm_pretrain() {
    : "${SLURM_JOB_ID:?run this through sbatch}"
    # First: SIGUSR1's default action would end this script.
    trap '_on_signal USR1' USR1
    trap '_on_signal TERM' TERM
    : "${CONFIG:?CONFIG must name a recipe YAML}"
    local restart=${SLURM_RESTART_COUNT:-0}
    local nnodes=${SLURM_JOB_NUM_NODES:-1}
    local nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    if [[ -z $nproc ]]; then
        _log "error: set NPROC_PER_NODE (no GPUs were allocated, so it cannot be derived)"
        return 2
    fi

    # Per job by default, so that two jobs of the same name never share checkpoints.
    local run_dir=${RUN_DIR:-runs/${SLURM_JOB_NAME:-pretrain}-$SLURM_JOB_ID}
    mkdir -p "$run_dir/logs"
    run_dir=$(cd "$run_dir" && pwd)
    local ckpt_dir=${CHECKPOINT_DIR:-$run_dir/checkpoints}
    local tb_dir=${TENSORBOARD_DIR:-$run_dir/tensorboard}
    # One log per job and attempt: a requeued job keeps its id and counts up SLURM_RESTART_COUNT.
    local log="$run_dir/logs/job-${SLURM_JOB_ID}.${restart}.log"

    local -a overrides=("checkpoint.save=$ckpt_dir"
                        "logging.tensorboard_dir=$tb_dir" "logging.log_dir=$run_dir/logs")
    local -a extra=()
    read -r -a extra <<<"${OVERRIDES:-}"
    overrides+=("${extra[@]}" "$@")

    local python=${PYTHON:-}
    local -a srun_args=(--nodes="$nnodes" --ntasks-per-node=1 --output="$log")
    local elastic="" spares=${SPARE_NODES:-0}
    if ((nnodes == 1)); then
        spares=0
    elif ((spares >= nnodes)) || [[ ! $spares =~ ^[0-9]+$ ]]; then
        _log "error: SPARE_NODES=$spares leaves no node to train on (the job has $nnodes)"
        return 2
    fi
    export SPARE_NODES=$spares
    ((spares > 0)) && elastic=", $spares of them hot spares"
    if [[ -n ${ELASTIC_MIN_NODES:-} ]] && ((nnodes > 1)); then
        elastic+=", elastic down to $ELASTIC_MIN_NODES node(s)"
        export ELASTIC_MIN_NODES
    else
        unset ELASTIC_MIN_NODES
    fi
    if [[ -n $elastic ]]; then
        # a lost node's task must not end the others': torchrun's agents go on without it
        srun_args+=(--kill-on-bad-exit=0 --no-kill)
    else
        srun_args+=(--kill-on-bad-exit=1)
    fi
    # srun no longer inherits the batch job's --cpus-per-task (Slurm >= 22.05).
    [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        local mounts
        mounts=$(_container_mounts "$run_dir" "$ckpt_dir" "$tb_dir")
        # the ranks refuse a config path outside these (megatron_ext/config/paths.py) before training
        export CONTAINER_MOUNTED=$mounts
        srun_args+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$mounts"
                    --container-workdir="$PWD")
        python=${python:-python}
    elif [[ -z $python && -x .venv/bin/python ]]; then
        python=$PWD/.venv/bin/python
    fi
    export PYTHON=${python:-python3} NPROC_PER_NODE=$nproc
    # `make install` builds a CPU-only torch for the rehearsal; on GPU nodes it would quietly
    # train on the CPUs.
    if [[ -z ${CONTAINER_IMAGE:-} && ${SLURM_GPUS_ON_NODE:-0} != 0 ]] &&
        [[ $("$PYTHON" -c 'import torch; print(torch.version.cuda is not None)') != True ]]; then
        _log "error: $PYTHON has a CPU-only torch but the job has GPUs; use CONTAINER_IMAGE or a CUDA torch"
        return 2
    fi
    if ((nnodes > 1)); then
        RDZV_ENDPOINT="$(_rdzv_host):${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
        export RDZV_ENDPOINT
    fi

    _log "restart $restart on $SLURM_JOB_NODELIST: $nnodes node(s) x $nproc process(es)$elastic, $CONFIG"
    _log "run directory $run_dir, training log $log"
    if [[ -f $ckpt_dir/latest_checkpointed_iteration.txt ]]; then
        _log "resuming from $ckpt_dir (iteration $(cat "$ckpt_dir/latest_checkpointed_iteration.txt"))"
    fi

    rm -rf "$run_dir/logs/run-result"  # this attempt's records only
    # In the background: bash runs a trap only between commands, and `wait` is interruptible.
    srun "${srun_args[@]}" bash launch/slurm/torchrun_node.sh --config "$CONFIG" "${overrides[@]}" &
    local srun_pid=$! rc=0
    while true; do
        wait "$srun_pid" && rc=0 || rc=$?
        # A trapped signal ends `wait` early (status > 128) while srun still runs: wait again.
        kill -0 "$srun_pid" 2>/dev/null || break
    done

    # How the run ended, from the records its ranks and launchers wrote (megatron_ext/resilience/run_record.py)
    local ENDED="" ITERATION="" FAILED_NODES="" SUSPECT_NODES=""
    eval "$(_run_record "$run_dir/logs")"
    if [[ $ENDED == "exit signal" ]]; then
        _log "training checkpointed and stopped early on a signal after iteration $ITERATION (srun exit $rc)"
        if ((_term_seen == 0)) && [[ ${REQUEUE_ON_SIGNAL:-1} == 1 ]]; then
            _log "requeueing: the next attempt resumes from $ckpt_dir"
            _requeue "" || return 1
        fi
        return 0
    fi
    if ((rc == 0)); then
        _log "training finished"
        return 0
    fi
    # elastic: a node's task ended (the node was lost) while the others finished the run (rank 0's summary line)
    if [[ -n $elastic && $ENDED == finished ]]; then
        _log "training finished on the nodes left (srun exit $rc: a node's task ended on the way)"
        return 0
    fi
    _log "training failed (srun exit $rc); see $log"
    if ((_term_seen == 1)); then
        return "$rc"  # cancelled or pre-empted: SLURM decides
    fi
    if ((rc == EXIT_USER_ERROR || rc == EXIT_DIVERGED || rc == EXIT_STORAGE)); then
        _log "not requeueing: exit $rc (config, data or checkpoint error, divergence, or a full or unwritable" \
             "disk) needs a fix first"
        return "$rc"
    fi
    if ((rc == EXIT_RERUN_ELSEWHERE)); then
        # train.recurring_fault=rerun_elsewhere: the step after the checkpoint runs again on other GPUs, which tells a
        # faulty GPU from bad data (megatron_ext/resilience/reruns.py)
        _requeue_after_failure "iteration $((ITERATION + 1))'s fault recurred when re-run on ${SUSPECT_NODES:-its node}" \
            "$SUSPECT_NODES" || return "$rc"
        return 0
    fi
    if ((rc == EXIT_HUNG)); then
        # The watchdog named the hung rank(s) in the log and wrote every live rank's stacks to rank-N.log.
        if [[ ${REQUEUE_ON_HANG:-1} == 1 ]]; then
            _requeue_after_failure "the hang watchdog ended the job (see $run_dir/logs/rank-*.log)" "" || return "$rc"
            return 0
        fi
        return "$rc"
    fi
    if [[ ${REQUEUE_ON_FAILURE:-1} == 1 ]]; then
        _requeue_after_failure "a rank failed${FAILED_NODES:+ on $FAILED_NODES}" "$FAILED_NODES" || return "$rc"
        return 0
    fi
    return "$rc"
}
