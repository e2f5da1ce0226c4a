#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (megatron-core 0.19's floor), 3.12 first (the version the suite runs on):
# python3.12, python3 or python3.13 on PATH, then the newest 3.12.x or 3.13.x that pyenv has installed (its shims
# refuse to run a version nobody selected). Prints nothing and exits 1 when there is none.
set -u
usable() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' >/dev/null 2>&1; }
for name in python3.12 python3 python3.13; do
  path=$(command -v "$name") && usable "$path" && { echo "$path"; exit 0; }
done
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for minor in 12 13; do
  for path in $(printf "%s\n" "$root"/versions/3."$minor".*/bin/python3."$minor" | sort -rV); do
    usable "$path" && { echo "$path"; exit 0; }
  done
done
exit 1
