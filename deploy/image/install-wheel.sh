#!/bin/sh
# The one way vramshare is installed into an image: from a directory of wheels, offline. The
# Dockerfile's runtime stage runs it, and tests/security/test_image.py runs it into a clean virtual
# environment, so what the test starts is what the image would run.
# Usage: install-wheel.sh WHEEL_DIR   (uses the `python` on PATH)
set -eu
exec python -m pip install --no-cache-dir --no-index --find-links "$1" vramshare
