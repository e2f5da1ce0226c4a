# Training image: NGC PyTorch with this project's pinned requirements on top.
#   docker build -t megatron-recipes:latest .
#   launch/docker_run.sh launch/torchrun.sh configs/llama3_8b_8gpu_bf16.yaml    (docs/docker.md)
#
# Base: NGC PyTorch 26.07 (Python 3.12, PyTorch 2.13.0a0, CUDA 13.3, Ubuntu 24.04, TransformerEngine 2.17,
# nvidia-resiliency-ext 0.6.0). megatron-core 0.19 declares no TransformerEngine range; its CI builds on the 26.06
# image with TE 2.17.1, and its code checks TE features up to 2.14. The build ends with recipes.doctor's version
# checks (megatron-core as pinned, TE inside recipes/doctor.py's TE_RANGE), so a tag whose versions fall outside
# fails here rather than at the first training step.
FROM nvcr.io/nvidia/pytorch:26.07-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# CUDA_DEVICE_MAX_CONNECTIONS=1: megatron-core's tensor/sequence-parallel communication
# overlap relies on kernels being issued in program order.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /workspace/megatron-recipes

# Requirements first: the layer stays cached while only the code changes.
COPY requirements.txt requirements-nvrx.txt ./
# The image pins every package it ships in /etc/pip/constraint.txt (PIP_CONSTRAINT). Drop the
# pins of the packages requirements.txt pins itself, keep all others (torch and
# TransformerEngine among them, so pip cannot replace the image's builds), add torch's exact
# build in case the list lacks it, and make the result the image's constraints for later installs.
RUN awk -F '[<>=!~;[ @]' ' \
        function norm(name) { name = tolower(name); gsub(/[-_.]+/, "-", name); return name } \
        FNR == NR { if ($1 != "" && $1 !~ /^#/) ours[norm($1)] = 1; next } \
        !(norm($1) in ours)' requirements.txt requirements-nvrx.txt /etc/pip/constraint.txt > /tmp/constraint.txt \
 && python -c 'import torch; print(f"torch=={torch.__version__}")' >> /tmp/constraint.txt \
 && grep -hv '^#' requirements.txt requirements-nvrx.txt >> /tmp/constraint.txt \
 && PIP_CONSTRAINT=/tmp/constraint.txt pip install --no-cache-dir -r requirements.txt -r requirements-nvrx.txt \
 && cp /tmp/constraint.txt /etc/pip/constraint.txt

# liger-kernel for train.liger_kernels and train.fused_linear_cross_entropy (Triton kernels; the image's Triton
# and torch stay: --no-deps).
RUN pip install --no-cache-dir --no-deps liger-kernel==0.8.5

# A non-root user (trainer, 10001) for the default command; numeric below so that runtimes
# can check it is not root without reading /etc/passwd. launch/docker_run.sh runs as the
# calling user instead, so that files written to the mounted directories belong to them.
RUN useradd --create-home --uid 10001 --user-group --shell /bin/bash trainer

COPY --chown=10001:10001 . .

# The versions this image was built for (recipes.doctor's checks, the source of the pins and of the TE range).
RUN python -c 'import sys; from recipes.doctor import Machine, check_versions; \
checks = check_versions(Machine(gpu=True, te=True, fp8=False)); print(*(f"{c.status} {c.name}: {c.detail}" for c in checks), sep="\n"); \
sys.exit(any(c.status != "PASS" for c in checks))'

USER 10001:10001

# NGC's entrypoint (driver and CUDA compatibility checks, then exec of the command) runs any
# recipe command: `docker run ... IMAGE torchrun --nproc-per-node 8 -m recipes.pretrain --config ...`.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
# First check on a new machine: `docker run ... IMAGE python -m recipes.doctor` (docs/docker.md).
CMD ["python", "-m", "recipes.pretrain", "--help"]
