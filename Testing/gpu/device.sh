#!/usr/bin/env bash
# The GPU check on a bare, offline GPU machine (docs/benchmarks.md, "The GPU check"):
#   bash Testing/gpu/device.sh [--budget 420] [--out DIR] [--device cuda|cpu] [--small] [--only CHECK ...] [--dry-run]
# Installs .gpu-wheels/ (made here by Testing/gpu/wheels.sh) into a private folder with pip
# --no-index --no-deps --target (nothing is downloaded), puts it on PYTHONPATH and runs
# Testing/gpu/device.py with the machine's python3 (or $PYTHON). report.json goes to $OUT when set.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${PYTHON:-python3}"
for a in "$@"; do
  if [ "$a" = "--dry-run" ] || [ "$a" = "--help" ] || [ "$a" = "-h" ]; then
    exec "$py" "$here/device.py" "$@"
  fi
done
wheels="${WHEELS_DIR:-$repo/.gpu-wheels}"
site="${DEVICE_SITE:-}"
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "device check: no wheels in $wheels: run bash Testing/gpu/wheels.sh first (where the registry is)" >&2
  exit 2
fi
t0=$(date +%s)
if [ -z "$site" ]; then  # a new private folder per run (never a fixed name another user could have made)
  site="$(mktemp -d "${TMPDIR:-/tmp}/medvol-device-site.XXXXXX")"
  trap 'rm -rf "$site"' EXIT
fi
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MEDVOL_HOME="${MEDVOL_HOME:-/tmp/medvol-home}"
echo "device check: wheels installed in $site in $(( $(date +%s) - t0 )) s"
cd "$repo"
"$py" "$here/device.py" "$@"
