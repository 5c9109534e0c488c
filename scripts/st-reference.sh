#!/usr/bin/env bash
# Runs scripts/st_bench.py in a throwaway venv with sentence-transformers on
# torch (from PyPI, hash-pinned in scripts/requirements/st-reference.txt; about 6 GB
# with torch's CUDA libraries, which stay unused).
# Created on first use under $STEAMRF_TOOLS/st-venv; only `steamrf bench embed`
# needs it, never the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
VENV="$TOOLS/st-venv"
# Every package, dependencies included, pinned with its hashes; binary wheels only.
REQS=scripts/requirements/st-reference.txt
reqs_sha=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$reqs_sha" ]; then
  echo "steamrf: creating $VENV ($REQS: torch==2.15.0, sentence-transformers==6.2.0, hash-pinned wheels); this takes a few minutes" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --require-hashes --only-binary=:all: -r "$REQS" >&2
  echo "$reqs_sha" > "$VENV/.requirements.sha256"
fi
exec "$VENV/bin/python" scripts/st_bench.py "$@"
