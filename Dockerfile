# Training image: NGC PyTorch with this project's pinned requirements on top.
#   docker build -t megatron-recipes:latest .
#   launch/docker_run.sh launch/torchrun.sh configs/llama3_8b_8gpu_bf16.yaml    (docs/docker.md)
#
# Base: NGC PyTorch 25.12 (PyTorch 2.10.0a0, CUDA 13.1, Python 3.12, Ubuntu 24.04). It ships
# TransformerEngine 2.10, the middle of the >=2.9,<2.12 range that megatron-core 0.16.1 declares
# (its [dev] extra requires transformer-engine>=2.9.0a0,<2.12.0); the neighbouring releases
# 25.11 (TE 2.9) and 26.01 (TE 2.11) are the range's edges. The build checks the range below,
# so a tag whose TE falls outside it fails here rather than at the first training step.
FROM nvcr.io/nvidia/pytorch:25.12-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# CUDA_DEVICE_MAX_CONNECTIONS=1: megatron-core's tensor/sequence-parallel communication
# overlap relies on kernels being issued in program order.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /workspace/megatron-recipes

# Requirements first: the layer stays cached while only the code changes.
COPY requirements.txt ./
# The image pins every package it ships in /etc/pip/constraint.txt (PIP_CONSTRAINT). Drop the
# pins of the packages requirements.txt pins itself, keep all others (torch and
# TransformerEngine among them, so pip cannot replace the image's builds), add torch's exact
# build in case the list lacks it, and make the result the image's constraints for later installs.
RUN awk -F '[<>=!~;[ @]' ' \
        function norm(name) { name = tolower(name); gsub(/[-_.]+/, "-", name); return name } \
        FNR == NR { if ($1 != "" && $1 !~ /^#/) ours[norm($1)] = 1; next } \
        !(norm($1) in ours)' requirements.txt /etc/pip/constraint.txt > /tmp/constraint.txt \
 && python -c 'import torch; print(f"torch=={torch.__version__}")' >> /tmp/constraint.txt \
 && grep -v '^#' requirements.txt >> /tmp/constraint.txt \
 && PIP_CONSTRAINT=/tmp/constraint.txt pip install --no-cache-dir -r requirements.txt \
 && cp /tmp/constraint.txt /etc/pip/constraint.txt \
 && python -c 'import megatron.core, torch, transformer_engine as te; \
from packaging.version import Version; \
v = Version(te.__version__.split("+")[0]); \
assert Version("2.9.0a0") <= v < Version("2.12.0"), f"TransformerEngine {te.__version__} is outside >=2.9,<2.12"; \
assert megatron.core.__version__ == "0.16.1", megatron.core.__version__; \
print(f"torch {torch.__version__}, TransformerEngine {te.__version__}, megatron-core {megatron.core.__version__}")'

# liger-kernel for train.liger_kernels and train.fused_linear_cross_entropy (Triton kernels; the image's Triton
# and torch stay: --no-deps).
RUN pip install --no-cache-dir --no-deps liger-kernel==0.8.5

# A non-root user (trainer, 10001) for the default command; numeric below so that runtimes
# can check it is not root without reading /etc/passwd. launch/docker_run.sh runs as the
# calling user instead, so that files written to the mounted directories belong to them.
RUN useradd --create-home --uid 10001 --user-group --shell /bin/bash trainer

COPY --chown=10001:10001 . .

USER 10001:10001

# NGC's entrypoint (driver and CUDA compatibility checks, then exec of the command) runs any
# recipe command: `docker run ... IMAGE torchrun --nproc-per-node 8 -m recipes.pretrain --config ...`.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
# First check on a new machine: `docker run ... IMAGE python -m recipes.doctor` (docs/docker.md).
CMD ["python", "-m", "recipes.pretrain", "--help"]
