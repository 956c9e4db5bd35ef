#!/usr/bin/env bash
# Set up, then run the main job on the embedded default models (Whisper base + int8 self-draft).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
    set -- ../shared/benchdata/audio/whisper/jfk.wav
fi
exec python -m app transcribe "$@" --format json
