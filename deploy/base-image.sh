#!/bin/sh
# The image deploy/Dockerfile builds FROM, printed on stdout: the public python:3.11-slim where it
# is here or can be pulled, else a Debian bookworm root with Python 3.11 made here by debootstrap
# (Debian's archive is often reachable where Docker Hub is not) and imported as kvfleet-base:bookworm.
# Made once: a second run finds the image. Needs root and debootstrap (apt-get install debootstrap).
#
#   deploy/base-image.sh [PUBLIC_IMAGE]          (make image runs it)
set -eu
DOCKER=${DOCKER:-docker}
PUBLIC=${1:-python:3.11-slim}
LOCAL=kvfleet-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

have() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

if have "$PUBLIC"; then echo "$PUBLIC"; exit 0; fi
if timeout "${PULL_TIMEOUT:-60}" "$DOCKER" pull -q "$PUBLIC" >/dev/null 2>&1; then echo "$PUBLIC"; exit 0; fi
if have "$LOCAL"; then echo "$LOCAL"; exit 0; fi

command -v debootstrap >/dev/null 2>&1 || {
    echo "deploy/base-image.sh: $PUBLIC cannot be pulled and debootstrap is missing (apt-get install debootstrap)" >&2
    exit 1
}
echo "deploy/base-image.sh: $PUBLIC cannot be pulled; making $LOCAL with debootstrap (a few minutes)" >&2
root=$(mktemp -d /tmp/kvfleet-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$root" "$MIRROR" >&2
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
# what python:3.11-slim sets that the build relies on: a UTF-8 locale and python3 as the command
tar -C "$root" -c . | "$DOCKER" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$LOCAL" >&2
echo "$LOCAL"
