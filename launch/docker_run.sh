#!/usr/bin/env bash
# Run a recipe command in the training image (./Dockerfile) with this checkout's data,
# checkpoint and TensorBoard directories mounted (docs/docker.md):
#   launch/docker_run.sh launch/torchrun.sh configs/llama3_8b_8gpu_bf16.yaml [section.key=value ...]
#   launch/docker_run.sh torchrun --nproc-per-node 8 -m recipes.pretrain --config configs/X.yaml
#   launch/docker_run.sh bash        # a shell in the container
# Environment:
#   IMAGE            image to run (default megatron-recipes:latest; build it with
#                    `docker build -t megatron-recipes:latest .`)
#   DATA_DIR         mounted at data/ in the image's checkout, where the configs look (default ./data)
#   RUNS_DIR         mounted at runs/, where the configs put checkpoints and TensorBoard events
#                    (default ./runs)
#   CHECKPOINT_DIR   optional: also mounted at /checkpoints, e.g. a parallel file system; point
#                    the recipe at it with checkpoint.save=/checkpoints/NAME (a run resumes from it)
#   TENSORBOARD_DIR  optional: also mounted at /tensorboard; use logging.tensorboard_dir=/tensorboard/NAME
#   MOUNT_CHECKOUT   1: mount this checkout over the image's copy of the code, so edited configs and code run
#                    without a rebuild (the image's Python packages stay); default 0: the code baked into the image
#   GPUS             docker --gpus value (default all; e.g. '"device=0,1"')
#   DOCKER_ARGS      extra docker run arguments, space separated (e.g. for InfiniBand:
#                    "--network=host --device=/dev/infiniband --cap-add=IPC_LOCK")
set -euo pipefail

cd "$(dirname "$0")/.."
image=${IMAGE:-megatron-recipes:latest}
workdir=/workspace/megatron-recipes
data_dir=${DATA_DIR:-$PWD/data}
runs_dir=${RUNS_DIR:-$PWD/runs}
# docker would create a missing mount source owned by root; create it as the caller instead.
mkdir -p "$data_dir" "$runs_dir"

args=(
    --rm
    --gpus "${GPUS:-all}"
    # NCCL and PyTorch's DataLoader exchange data through shared memory: the host's IPC
    # namespace instead of docker's 64 MB /dev/shm.
    --ipc=host
    # Unlimited pinned (page-locked) memory for NCCL and CUDA host buffers, and the 64 MB stack
    # NVIDIA recommends for its PyTorch images.
    --ulimit memlock=-1
    --ulimit stack=67108864
    # The calling user, so that checkpoints and events on the mounts belong to them; HOME must
    # then be somewhere writable for the caches (Triton, torch.compile).
    --user "$(id -u):$(id -g)"
    --env HOME=/tmp
)
# src:dst of every mount; the ranks refuse a config path outside them (megatron_ext/config/paths.py): a checkpoint
# written elsewhere would stay in the container and vanish with it
mounts=("$(cd "$data_dir" && pwd):$workdir/data" "$(cd "$runs_dir" && pwd):$workdir/runs")
if [[ ${MOUNT_CHECKOUT:-0} == 1 ]]; then
    mounts+=("$PWD:$workdir")
fi
if [[ -n ${CHECKPOINT_DIR:-} ]]; then
    mkdir -p "$CHECKPOINT_DIR"
    mounts+=("$(cd "$CHECKPOINT_DIR" && pwd):/checkpoints")
fi
if [[ -n ${TENSORBOARD_DIR:-} ]]; then
    mkdir -p "$TENSORBOARD_DIR"
    mounts+=("$(cd "$TENSORBOARD_DIR" && pwd):/tensorboard")
fi
# Settings from the host reach the ranks: NCCL_DEBUG, NCCL_SOCKET_IFNAME, ..., W&B's (WANDB_API_KEY, WANDB_MODE, ...)
# and NPROC for launch/torchrun.sh.
while IFS= read -r name; do
    args+=(--env "$name")
done < <(compgen -e | grep -E '^(NCCL_|TORCH_NCCL_|TORCH_DISTRIBUTED_|PET_|WANDB_|NPROC$|OMP_NUM_THREADS$|CUDA_VISIBLE_DEVICES$)' || true)
# An interactive terminal only when there is one (not under nohup, cron or CI).
if [[ -t 0 && -t 1 ]]; then
    args+=(--interactive --tty)
fi
if [[ -n ${DOCKER_ARGS:-} ]]; then
    read -r -a extra <<<"$DOCKER_ARGS"
    args+=("${extra[@]}")
    for ((i = 0; i < ${#extra[@]}; i++)); do  # volumes given there count as mounts too
        case ${extra[i]} in
            -v | --volume) mounts+=("${extra[i + 1]:-}") ;;
            --volume=*) mounts+=("${extra[i]#--volume=}") ;;
        esac
    done
fi
for mount in "${mounts[@]}"; do
    args+=(--volume "$mount")
done
args+=(--env "CONTAINER_MOUNTED=$(IFS=,; echo "${mounts[*]}")")

exec docker run "${args[@]}" "$image" "$@"
