#!/usr/bin/env bash
# Set up, then run the main job: the server on the embedded default models
# (Whisper base + its int8 self-draft) at http://127.0.0.1:8000 (extra arguments go to `serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m app serve "$@"
