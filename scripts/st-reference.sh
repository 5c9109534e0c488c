#!/usr/bin/env bash
# Runs scripts/st_bench.py in a throwaway venv with sentence-transformers on
# torch (from PyPI; about 6 GB with torch's CUDA libraries, which stay unused).
# Created on first use under $STEAMRF_TOOLS/st-venv; only `steamrf bench embed`
# needs it, never the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
VENV="$TOOLS/st-venv"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sentence_transformers" 2>/dev/null; then
  echo "steamrf: creating $VENV (torch==2.15.0, sentence-transformers==6.2.0); this takes a few minutes" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.15.0" "sentence-transformers==6.2.0" >&2
fi
exec "$VENV/bin/python" scripts/st_bench.py "$@"
