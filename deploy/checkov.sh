#!/bin/sh
# Run checkov on deploy/ and the Dockerfile, as tests/security/test_checkov.py does.
# checkov pins older versions of shared packages (packaging, importlib-metadata, ...), so it lives in
# its own virtual environment under .tools/checkov (created on first use: ~50 s, ~300 MB), never in
# the project's environment.   Usage: deploy/checkov.sh [--install-only] [extra checkov args]
set -eu
root="$(cd "$(dirname "$0")/.." && pwd)"
tool="$root/.tools/checkov"
if [ ! -x "$tool/bin/checkov" ]; then
  python3 -m venv "$tool"
  "$tool/bin/pip" install --quiet "checkov>=3.2,<4"
fi
[ "${1:-}" = "--install-only" ] && exit 0
cd "$root"
# BC_SKIP_MAPPING: no download of the guideline links (runs offline).
export BC_SKIP_MAPPING=TRUE
rc=0
"$tool/bin/checkov" --directory deploy --framework kubernetes --compact --quiet "$@" || rc=$?
"$tool/bin/checkov" --file Dockerfile --framework dockerfile --compact --quiet "$@" || rc=$?
exit "$rc"
