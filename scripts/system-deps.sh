#!/usr/bin/env bash
# Install the Debian packages the test suite drives for real: HAProxy (the load balancer in the deployment
# tests), Chromium with its driver (the browser tests of the web page) and a C++ compiler with ninja (the
# kernel library, built for this CPU by torch's extension loader). Skips what is already there.
# Needs root and apt (as on the CI machines); elsewhere it only says what is missing.
set -euo pipefail
want=()
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || want+=(haproxy)
command -v chromium >/dev/null 2>&1 || want+=(chromium)
command -v chromedriver >/dev/null 2>&1 || want+=(chromium-driver)
command -v g++ >/dev/null 2>&1 || want+=(g++)
command -v ninja >/dev/null 2>&1 || want+=(ninja-build)
if [ ${#want[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: missing ${want[*]} (install them with your package manager)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
