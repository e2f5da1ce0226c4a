#!/usr/bin/env bash
# Single-node launcher for CPU rehearsal and GPU nodes alike.
#   launch/torchrun.sh configs/tiny.yaml [section.key=value ...]
# NPROC defaults to the GPU count (nvidia-smi), or to the recipe's recipe.gpus on a CPU machine.
# Multi-node: run one torchrun per node with a c10d rendezvous on the first node, e.g.
#   torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" \
#            --rdzv-id "$JOB_ID" -m recipes.pretrain --config configs/llama3_70b_64gpu_bf16.yaml
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 CONFIG.yaml [section.key=value ...]" >&2
    exit 2
fi
config=$1
shift

cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] && python=.venv/bin/python

if [[ -z "${NPROC:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        NPROC=$(nvidia-smi -L | wc -l)
    else
        NPROC=$("$python" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['recipe']['gpus'])" "$config")
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # several CPU processes share the cores
    fi
fi

# torchrun's agent, run by recipes.launch: the config is checked once before any rank starts, and a failed run
# ends in one line naming the rank and its log (megatron_ext/errors.py lists the exit codes).
exec "$python" -m recipes.launch --standalone --nproc-per-node "$NPROC" --config "$config" "$@"
