#!/usr/bin/env bash
# Build SpecWhisper's images on a host that cannot pull from Docker Hub (offline, air-gapped, or behind a
# proxy that lets only package mirrors through), with the same Dockerfiles as everywhere else:
#
#   1. base images: the official python:3.11-slim-bookworm and haproxy:2.8 when they can be had (already
#      present, or pulled); otherwise stand-ins made from Debian's packages: a bookworm root filesystem from
#      debootstrap, imported as specwhisper-local/debian:bookworm, then docker/base/*.Dockerfile on it.
#   2. torch: the host's CPU wheel (pip finds it without an index: `pip download --no-index`) copied into
#      docker/wheels/, which the Dockerfile installs from; without one, PyTorch's CPU index.
#   3. the project's images: specwhisper:cpu (models baked in), specwhisper:cpu-slim (no models) and
#      specwhisper-lb (HAProxy with docker/haproxy/haproxy.cfg), with pip's CA bundle (and configuration, if
#      given) as build secrets: never in an image layer.
#
# Usage: docker/build-local.sh [--local-bases] [--no-slim]
#   --local-bases  use (or make) the Debian stand-ins without trying Docker Hub first
#   --no-slim      skip the slim image
# Environment: PIP_CERT (pip's CA bundle; default: pip's configured `cert`), PIP_CONF_SECRET (a pip.conf to
# pass as the pip_conf secret), DEBIAN_MIRROR (debootstrap's, default http://deb.debian.org/debian),
# SPECWHISPER_IMAGE / SPECWHISPER_SLIM_IMAGE / SPECWHISPER_LB_IMAGE (the tags), DOCKER (the client).
# Needs BuildKit: `docker buildx`, or a Docker client older than 23 (DOCKER_BUILDKIT=1, built in).
# Making the Debian base needs root and debootstrap (apt-get install debootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."

local_bases=0
slim=1
for arg in "$@"; do
    case "$arg" in
        --local-bases) local_bases=1 ;;
        --no-slim) slim=0 ;;
        *) echo "usage: $0 [--local-bases] [--no-slim]" >&2; exit 2 ;;
    esac
done

IMAGE=${SPECWHISPER_IMAGE:-specwhisper:cpu}
SLIM_IMAGE=${SPECWHISPER_SLIM_IMAGE:-specwhisper:cpu-slim}
LB_IMAGE=${SPECWHISPER_LB_IMAGE:-specwhisper-lb:latest}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LOCAL_DEBIAN=specwhisper-local/debian:bookworm
LOCAL_PYTHON=specwhisper-local/python:3.11-bookworm
LOCAL_HAPROXY=specwhisper-local/haproxy:2.6-bookworm

log() { printf 'build-local: %s\n' "$*" >&2; }

# --- a client that builds with BuildKit (secrets and bind mounts need it) ---------------------------------
docker_cli=${DOCKER:-}
build=()
if [ -z "$docker_cli" ]; then
    for candidate in docker /usr/bin/docker; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" buildx version >/dev/null 2>&1; then
            docker_cli=$candidate
            build=("$candidate" buildx build --load)
            break
        fi
        major=$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then
            docker_cli=$candidate
            build=(env DOCKER_BUILDKIT=1 "$candidate" build)
            break
        fi
    done
else
    build=(env DOCKER_BUILDKIT=1 "$docker_cli" build)
fi
if [ ${#build[@]} -eq 0 ]; then
    echo "build-local: no Docker client that builds with BuildKit (install buildx, or Debian's docker.io)" >&2
    exit 1
fi
docker() { "$docker_cli" "$@"; }

have() { docker image inspect "$1" >/dev/null 2>&1; }

# An official image if it is here or can be pulled (within a minute); else "".
official() {
    if have "$1"; then echo "$1"; return; fi
    if [ "$local_bases" = 0 ] && timeout 60 "$docker_cli" pull -q "$1" >/dev/null 2>&1; then echo "$1"; return; fi
    echo ""
}

debian_base() {
    have "$LOCAL_DEBIAN" && return
    command -v debootstrap >/dev/null || { echo "build-local: debootstrap is needed (apt-get install debootstrap)" >&2; exit 1; }
    local root
    root=$(mktemp -d)
    log "debootstrap bookworm (minbase) into $root"
    debootstrap --variant=minbase bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root.log" 2>&1 \
        || { tail -20 "$root.log" >&2; exit 1; }
    # As Debian's own slim images: apt keeps no downloaded packages or caches, dpkg installs no manuals.
    cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'APT'
APT::Keep-Downloaded-Packages "false";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT
    cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'DPKG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
DPKG
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$LOCAL_DEBIAN" >/dev/null
    rm -rf "$root" "$root.log"
}

local_base() {  # local_base TAG DOCKERFILE
    have "$1" && return
    debian_base
    log "building the stand-in $1"
    "${build[@]}" -q --build-arg DEBIAN_IMAGE="$LOCAL_DEBIAN" -f "$2" -t "$1" docker/base >/dev/null
}

python_image=$(official python:3.11-slim-bookworm)
if [ -z "$python_image" ]; then
    local_base "$LOCAL_PYTHON" docker/base/python.Dockerfile
    python_image=$LOCAL_PYTHON
fi
haproxy_image=$(official haproxy:2.8)
if [ -z "$haproxy_image" ]; then
    local_base "$LOCAL_HAPROXY" docker/base/haproxy.Dockerfile
    haproxy_image=$LOCAL_HAPROXY
fi
log "bases: $python_image, $haproxy_image"

# --- torch: the host's wheel, if pip has one on local disk -------------------------------------------------
if ! ls docker/wheels/torch-*.whl >/dev/null 2>&1; then
    if python3 -m pip download -q --no-deps --no-index --only-binary :all: --python-version 3.11 \
        --dest docker/wheels "torch==${TORCH_VERSION}" >/dev/null 2>&1; then
        log "torch from the host's wheel: $(basename docker/wheels/torch-*.whl)"
    else
        log "no local torch wheel: the build takes torch from PyPI's CPU index"
    fi
fi

# --- secrets -----------------------------------------------------------------------------------------------
secrets=()
ca=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
if [ -n "$ca" ] && [ -s "$ca" ]; then secrets+=(--secret "id=pip_ca,src=$ca"); fi
if [ -n "${PIP_CONF_SECRET:-}" ]; then secrets+=(--secret "id=pip_conf,src=$PIP_CONF_SECRET"); fi

# --- the project's images ----------------------------------------------------------------------------------
# What the tags name now: a rebuild moves the tags, and an image left with no tag (and no container) is removed
# at the end, so repeated builds do not pile up untagged gigabytes. The build cache keeps the layers.
declare -A before=()
for tag in "$IMAGE" "$SLIM_IMAGE" "$LB_IMAGE"; do
    before[$tag]=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
done
args=(--build-arg "PYTHON_IMAGE=$python_image" --build-arg "TORCH_VERSION=$TORCH_VERSION" "${secrets[@]}")
log "building $IMAGE"
"${build[@]}" "${args[@]}" -t "$IMAGE" .
if [ "$slim" = 1 ]; then
    log "building $SLIM_IMAGE"
    "${build[@]}" "${args[@]}" --target slim -t "$SLIM_IMAGE" .
fi
log "building $LB_IMAGE"
"${build[@]}" --build-arg "HAPROXY_IMAGE=$haproxy_image" -f docker/haproxy/Dockerfile -t "$LB_IMAGE" .

for tag in "${!before[@]}"; do
    old=${before[$tag]}
    [ -n "$old" ] || continue
    [ "$old" = "$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)" ] && continue
    if [ -z "$(docker image inspect -f '{{join .RepoTags ""}}' "$old" 2>/dev/null)" ] \
        && docker image rm "$old" >/dev/null 2>&1; then
        log "removed the image $tag named before (${old:7:12})"
    fi
done

images=("$IMAGE" "$LB_IMAGE")
if [ "$slim" = 1 ]; then images+=("$SLIM_IMAGE"); fi
for image in "${images[@]}"; do
    printf '%s\t%s MB\n' "$image" "$(( $(docker image inspect -f '{{.Size}}' "$image") / 1000000 ))"
done
