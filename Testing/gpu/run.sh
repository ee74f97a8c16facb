#!/usr/bin/env bash
# One-command GPU check: bash Testing/gpu/run.sh [options] (see --help). Run it from anywhere after
# the README's set-up (python3 MedVolCore/bootstrap.py). On a machine without a CUDA GPU it says so
# and exits 0 after checking its own arguments.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${MEDVOL_PYTHON:-$repo/.venv/bin/python}"
if [ ! -x "$py" ]; then
  echo "gpu check: $py not found; run 'python3 MedVolCore/bootstrap.py' first (or set MEDVOL_PYTHON)" >&2
  exit 2
fi
cd "$repo"
exec "$py" "$here/check.py" "$@"
