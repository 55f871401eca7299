#!/bin/sh
# Build the vramshare image with docker, podman or buildah (the first one found; BUILDER= to choose).
#   deploy/build-image.sh                 # builds ghcr.io/vramshare/vramshare:<version in pyproject.toml>
#   deploy/build-image.sh my.registry/vramshare:dev
#   deploy/build-image.sh --print-image   # the reference it would build (what the manifests name)
# Push it yourself (docker push ...), or load it into kind: kind load docker-image <ref>.
set -eu
root="$(cd "$(dirname "$0")/.." && pwd)"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n 1)"
default="ghcr.io/vramshare/vramshare:$version"
if [ "${1:-}" = "--print-image" ]; then
  echo "$default"
  exit 0
fi
image="${1:-$default}"
builder="${BUILDER:-}"
if [ -z "$builder" ]; then
  for b in docker podman buildah; do
    if command -v "$b" >/dev/null 2>&1; then builder="$b"; break; fi
  done
fi
case "$builder" in
  docker) DOCKER_BUILDKIT=1 exec docker build -t "$image" -f "$root/Dockerfile" "$root" ;;
  podman) exec podman build -t "$image" -f "$root/Dockerfile" "$root" ;;
  buildah) exec buildah bud -t "$image" -f "$root/Dockerfile" "$root" ;;
  *) echo "build-image.sh: no docker, podman or buildah on PATH (set BUILDER=)" >&2; exit 1 ;;
esac
