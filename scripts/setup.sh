#!/usr/bin/env bash
# Install sglang (editable) with its test extras into the current Python environment.
#
# torch is not pinned by the package, so GPU users keep their CUDA build. This script picks the
# torch build by SGLANG_TORCH:
#   auto (default): keep an installed torch; else the CPU build when no NVIDIA GPU is visible
#                   (pip install torch==2.13.0, which these CPU machines hold on disk), else let
#                   pip choose (a CUDA build).
#   cpu:            the CPU build (torch==2.13.0, falling back to PyTorch's CPU wheel index).
#   skip:           do not touch torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip"
choice=${SGLANG_TORCH:-auto}

install_cpu_torch() {
  $PIP install -q "torch==2.13.0" ||
    $PIP install -q torch --index-url https://download.pytorch.org/whl/cpu
}

if [ "$choice" = "cpu" ]; then
  install_cpu_torch
elif [ "$choice" = "auto" ] && ! $PY -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found; pip will choose a CUDA build of torch"
  else
    echo "setup: no GPU found; installing the CPU build of torch"
    install_cpu_torch
  fi
fi
$PIP install -q -e ".[test]"
echo "setup: done ($($PY -c 'import torch; print("torch", torch.__version__)'))"
