# syntax=docker/dockerfile:1
# One image for the device plugin, the extender and the CLI (deploy/build-image.sh builds it; the
# manifests name the reference it produces). The builder stage turns the source into wheels (ours
# and every dependency); the runtime stage installs only those wheels, offline, with
# deploy/image/install-wheel.sh: no source tree, no build tools, no compilers, no pip cache.
# The default user is non-root (65532); the device plugin's DaemonSet runs it as root, which it
# needs for the kubelet's socket directory (see deploy/daemonset/device-plugin.yaml).
# Both stages use the same base (a pinned minor release, never :latest).
FROM docker.io/library/python:3.11-slim-bookworm AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vramshare/ vramshare/
COPY standins/ standins/
COPY vramshare_cli/ vramshare_cli/
COPY deviceplugin/ deviceplugin/
COPY extender/ extender/
COPY protos/ protos/
COPY vllm_patches/ vllm_patches/
# the manifests `vramshare install` renders (vramshare_cli/deploy links here; the wheel carries a copy)
COPY deploy/ deploy/
RUN python -m pip install --no-cache-dir "setuptools>=68" wheel \
 && python -m pip wheel --no-cache-dir --wheel-dir /wheels .

FROM docker.io/library/python:3.11-slim-bookworm AS runtime
COPY deploy/image/install-wheel.sh /tmp/install-wheel.sh
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    sh /tmp/install-wheel.sh /wheels \
 && rm /tmp/install-wheel.sh \
 && (python -m pip uninstall --yes pip setuptools wheel >/dev/null 2>&1 || true)
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 65532:65532
# Kubernetes probes the daemons over HTTP (see the manifests); no Docker healthcheck.
HEALTHCHECK NONE
CMD ["vramshare", "--help"]
