#!/usr/bin/env bash
# Dependency audit of the project's environment with pip-audit: fails on any known vulnerability.
# pip-audit asks PyPI's vulnerability API; where that cannot be reached (a mirror without it, no
# network), it cannot audit and this script says so loudly instead of passing silently.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
out=$(timeout 600 pip-audit --progress-spinner off --local 2>&1)
rc=$?
unaudited=$(grep -c "could not be audited" <<<"$out")
if [ "$rc" -ne 0 ]; then
    echo "$out"
    echo "pip-audit: FAILED (exit $rc)" >&2
    exit "$rc"
fi
if [ "$unaudited" -gt 0 ]; then
    echo "pip-audit: NOT AUDITED - the vulnerability service was unreachable for $unaudited dependencies"
else
    echo "pip-audit: no known vulnerabilities"
fi
