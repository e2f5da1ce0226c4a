#!/usr/bin/env bash
# Installs requirements-nvrx.txt (NVIDIA Resiliency Extension) with the Python given ($1, a venv's). NVRx >= 0.5
# publishes manylinux_2_39 wheels only: where glibc is older (Debian 12), pip finds none, and the same wheel is
# unpacked into site-packages instead. Its Python code runs on any glibc; its one native module (CUPTI kernel timing,
# for GPU straggler detection) is loaded neither by the ft_launcher (recipes.launch --nvrx) nor by megatron-core.
set -euo pipefail
python=$1
requirements="$(cd "$(dirname "$0")/.." && pwd)/requirements-nvrx.txt"
if "$python" -m pip install -q -r "$requirements" 2>/dev/null; then
  exit 0
fi
spec=$(grep -E '^nvidia-resiliency-ext==' "$requirements")
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: --platform "manylinux_2_39_$(uname -m)" -d "$wheels" "$spec"
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$python" -m zipfile -e "$wheels"/*.whl "$site"
echo "installed $spec by unpacking its manylinux_2_39 wheel (this machine's glibc is older)"
