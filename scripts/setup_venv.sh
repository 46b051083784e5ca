#!/usr/bin/env bash
# Create or update the dev venv: pinned frameworks + test tools + commsched in
# development (editable) mode + the mxnet/numpy shim. Idempotent; 'make venv'
# runs it only when a requirement file changed (stamp .venv/.stamp-venv).
#
# Environment: VENV (default <repo>/.venv), PYTHON (default python3, >= 3.10).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(realpath -m "${VENV:-$ROOT/.venv}")
PYTHON=${PYTHON:-python3}
REQ=$ROOT/requirements
C=(-c "$REQ/constraints.txt")

say() { echo "[setup_venv] $*"; }
die() { echo "[setup_venv] ERROR: $*" >&2; exit 1; }
t0=$(date +%s)

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$PYTHON is older than 3.10 (set PYTHON=...)"

# A venv whose interpreter no longer runs (moved, or made on another machine) is rebuilt.
if [ -e "$VENV" ] && ! "$VENV/bin/python" -c 'pass' >/dev/null 2>&1; then
  say "$VENV is broken; recreating it"
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV" || die "step 'python -m venv' failed"
fi
PY=$VENV/bin/python
# pip's output goes to a log (this machine's pip config adds a warning per
# package); shown when a step fails.
LOG=$VENV/.setup-venv.log
: >"$LOG"
pip() { "$PY" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1; }
failed() { tail -n 30 "$LOG" >&2; die "step '$1' failed (log: $LOG)"; }

say "installing pinned packages (first time: a few minutes)"
pip install "${C[@]}" -r "$REQ/tools.txt" || failed "install tools"
# One resolve for everything, so numpy ends where TF and mxnet both accept it.
pip install "${C[@]}" -r "$REQ/torch.txt" -r "$REQ/tensorflow.txt" -r "$REQ/mxnet.txt" \
  -r "$REQ/test.txt" -r "$REQ/horovod.txt" -r "$REQ/planner.txt" -r "$REQ/tuner.txt" -r "$REQ/progress.txt" || failed "install frameworks"
pip install --no-deps "${C[@]}" -r "$REQ/tf-keras.txt" || failed "install tf-keras"

# mxnet/numpy shim, at the environment level (commsched itself patches nothing).
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$ROOT/scripts/commsched_mxnet_numpy_compat.py" "$SITE/"
echo "import commsched_mxnet_numpy_compat" >"$SITE/commsched_mxnet_numpy_compat.pth"

say "installing commsched (editable)"
pip install --no-deps --no-build-isolation -e "$ROOT" || failed "pip install -e ."

say "checking that torch, tensorflow and mxnet import in one process"
out=$(cd / && "$PY" - 2>&1 <<'EOF'
import torch, tensorflow, mxnet, numpy  # noqa: E401
print(f"[setup_venv] torch {torch.__version__}, tensorflow {tensorflow.__version__}, "
      f"mxnet {mxnet.__version__}, numpy {numpy.__version__}")
EOF
) || { echo "$out" >&2; die "step 'import check' failed: torch, tensorflow and mxnet do not import together"; }
echo "$out" | grep '^\[setup_venv\]' 

# tf-keras declares 'tensorflow' (we have tensorflow-cpu, same modules): not a problem.
problems=$("$PY" -m pip check 2>&1 | grep -v -i '^tf-keras .* requires tensorflow' | grep -v -i '^No broken' || true)
[ -z "$problems" ] || say "note: 'pip check' reports: $problems"
say "done in $(( $(date +%s) - t0 )) s"
