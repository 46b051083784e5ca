#!/usr/bin/env bash
# Regenerate requirements/constraints.txt from the current venv (after changing a
# top-level pin in requirements/*.txt and running 'make venv' successfully).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${VENV:-$ROOT/.venv}/bin/python
OUT=$ROOT/requirements/constraints.txt
{
  sed -n '/^#/p' "$OUT"   # keep the header
  # commsched itself and horovod (built by scripts/build_horovod.sh) are not pinned here;
  # torch loses its local label so that == matches the local CPU wheel.
  "$PY" -m pip freeze --exclude-editable --all \
    | grep -v -i -E '^(commsched|horovod)[=@ ]' \
    | sed -E 's/^torch==([0-9.]+)\+[a-z0-9]+$/torch==\1/'
} >"$OUT.new"
mv "$OUT.new" "$OUT"
echo "wrote $OUT ($(grep -vc '^#' "$OUT") pins)"
