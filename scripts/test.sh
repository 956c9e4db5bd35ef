#!/usr/bin/env bash
# Set up (with dev tools and the system packages the tests drive), then lint, type-check, check the import
# layers and run the whole test suite: what CI runs.
#
# Usage: scripts/test.sh [--quick] [PYTEST ARGS...]
#   --quick  the quick tier, for a check while working (a few minutes): no system packages and no
#            dependency audit; set-up (reusing .venv), lint, types, import layers, then only the tests
#            marked `quick` (tests/conftest.py: those that start no server and are not marked slow).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then
    quick=1
    shift
fi
if [ "$quick" = 0 ]; then
    bash scripts/system-deps.sh
fi
scripts/setup.sh dev,compare,ray,bench
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check app tests
ruff format --check app tests
# mypy's cache outside the checkout: a fresh clone then re-checks only what changed (~5 s, not ~85 s
# of reading torch's stubs). It validates each entry against the files' contents.
MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specwhisper/mypy}" mypy
lint-imports
if [ "$quick" = 1 ]; then
    python -m pytest -q -p no:cacheprovider --durations=15 -m quick "$@"
else
    bash scripts/audit.sh
    python -m pytest -q -p no:cacheprovider --durations=15 "$@"
fi
