#!/usr/bin/env bash
# Set up (with dev tools and the system packages the tests drive), then lint, type-check and run the
# whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
scripts/setup.sh dev,compare
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check app tests
ruff format --check app tests
# mypy's cache outside the checkout: a fresh clone then re-checks only what changed (~5 s, not ~85 s
# of reading torch's stubs). It validates each entry against the files' contents.
MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specwhisper/mypy}" mypy
bash scripts/audit.sh
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
