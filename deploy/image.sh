#!/bin/sh
# `make image`: the kvfleet image, kvfleet:$VARIANT, built with BuildKit from the repository root.
#   - the base: python:3.11-slim, or where it cannot be pulled the Debian base deploy/base-image.sh makes;
#   - the CPU variant's torch: a CPU wheel of torch 2.13.0 that pip finds on this disk (its --find-links)
#     goes in as an image holding only that file (made once, mounted for one step, in no layer of the
#     result); without one, the Dockerfile takes PyTorch's CPU index;
#   - a certificate pip is set to trust here ($PIP_CERT, else the cert `pip config list` names) goes in
#     as the BuildKit secret pip-cert: present for the pip steps, written into no layer.
# Rebuilds reuse the layer cache. Environment: VARIANT (cpu), PYTHON_IMAGE, TAG, DOCKER, PIP (the host's pip),
# NO_CACHE.
set -eu
cd "$(dirname "$0")/.."
VARIANT=${VARIANT:-cpu}
TAG=${TAG:-kvfleet:$VARIANT}
PIP=${PIP:-python3 -m pip}
TORCH=2.13.0

fail() { echo "make image: $*" >&2; exit 1; }

# A client that builds with BuildKit: one with the buildx plugin, or one older than 23.0 (BuildKit
# built in, DOCKER_BUILDKIT=1); a newer one without buildx can only use the legacy builder, which has
# no build secrets. Debian's docker.io client (/usr/bin/docker) is of the second kind.
buildkit_client() {
    for client in ${DOCKER:-docker /usr/bin/docker}; do
        command -v "$client" >/dev/null 2>&1 || continue
        if "$client" buildx version >/dev/null 2>&1; then echo "$client"; return; fi
        version=$("$client" version --format '{{.Client.Version}}' 2>/dev/null || true)
        if [ -n "$version" ] && [ "${version%%.*}" -lt 23 ] 2>/dev/null; then echo "$client"; return; fi
    done
    fail "no docker client that builds with BuildKit (install the buildx plugin, or set DOCKER=...)"
}
DOCKER=$(buildkit_client)
export DOCKER
"$DOCKER" info >/dev/null 2>&1 || fail "the Docker engine does not answer (start dockerd)"

base=$(deploy/base-image.sh "${PYTHON_IMAGE:-python:3.11-slim}") || fail "no base image"
set -- --build-arg "VARIANT=$VARIANT" --build-arg "PYTHON_IMAGE=$base"

if [ "$VARIANT" = cpu ]; then
    wheels=build/wheelhouse   # ignored by git and by the build context
    mkdir -p "$wheels"
    wheel=$(ls "$wheels"/torch-"$TORCH"+cpu-*.whl 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then  # --no-index: only what lies on this disk (pip's --find-links), never PyPI's CUDA build
        $PIP download -q --no-deps --no-index -d "$wheels" "torch==$TORCH+cpu" >/dev/null 2>&1 || true
        wheel=$(ls "$wheels"/torch-"$TORCH"+cpu-*.whl 2>/dev/null | head -n 1)
    fi
    if [ -n "$wheel" ]; then
        wheelhouse="kvfleet-wheelhouse:torch-$TORCH-cpu"
        if ! "$DOCKER" image inspect "$wheelhouse" >/dev/null 2>&1; then
            tar -C "$wheels" -c "$(basename "$wheel")" | "$DOCKER" import - "$wheelhouse" >/dev/null
        fi
        set -- "$@" --build-arg "TORCH_WHEELHOUSE=$wheelhouse"
        echo "make image: torch from $wheel" >&2
    else
        echo "make image: no CPU wheel of torch $TORCH on this disk; the build takes PyTorch's CPU index" >&2
    fi
fi

cert=${PIP_CERT:-$($PIP config list 2>/dev/null | sed -n "s/^[^=]*\.cert='\(.*\)'$/\1/p" | head -n 1)}
if [ -n "$cert" ]; then
    [ -s "$cert" ] || fail "pip's certificate $cert is not a file"
    set -- "$@" --secret "id=pip-cert,src=$cert"
    echo "make image: pip trusts $cert (a build secret)" >&2
fi

echo "make image: $TAG from $base" >&2
# NO_CACHE=1: every step run again (make deploy-check's cold build)
DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain ${NO_CACHE:+--no-cache} -f deploy/Dockerfile -t "$TAG" "$@" .
