#!/usr/bin/env bash
# Set up (with dev tools), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check app tests
ruff format --check app tests
mypy
python -m pytest -q -p no:cacheprovider "$@"
