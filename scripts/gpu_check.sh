#!/usr/bin/env bash
# Check commsched's CUDA path on a machine with a GPU, in under 5 minutes:
#   scripts/gpu_check.sh [summary.json]      (default: $OUT/gpu_check.json, else ./gpu_check.json)
# Runs, each under `timeout`: the CPU fake-stream tests, one NCCL rank (training equals plain
# training; with split_tied_embeddings too), AMP (GradScaler on the synchronous path, refused
# cross-iteration), and two processes on one GPU over gloo-on-CUDA. Writes a JSON summary (passed/failed per check,
# torch and CUDA versions, device name) and exits non-zero if any check failed or there is no GPU.
set -u
cd "$(dirname "$0")/.."
SUMMARY="${1:-${OUT:+$OUT/gpu_check.json}}"
SUMMARY="${SUMMARY:-gpu_check.json}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
LOGDIR="$(mktemp -d)"
export COMMSCHED_TEST_GPU=1

write_summary() {  # $1: JSON list of checks, $2: error or empty
  "$PY" - "$SUMMARY" "$1" "$2" <<'PYEOF'
import json, sys
path, checks, error = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
info = {"torch": None, "cuda": None, "device": None}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
except Exception as exc:  # report, do not crash the summary
    error = error or f"import torch failed: {exc!r}"
ok = not error and bool(checks) and all(c["passed"] for c in checks)
json.dump({"passed": ok, "error": error or None, "checks": checks, **info}, open(path, "w"), indent=2)
print(json.dumps({"passed": ok, "error": error or None, **info}))
PYEOF
}

if ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.distributed.is_nccl_available() else 1)'; then
  write_summary '[]' "no CUDA device with NCCL is visible to torch (torch.cuda.is_available() is False); run this on a GPU machine"
  exit 2
fi

CHECKS="[]"
run_check() {  # $1 name, $2 seconds, rest: pytest node ids
  local name="$1" limit="$2"; shift 2
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$PY" -m pytest "$@" -p no:cacheprovider --import-mode=importlib -q -rs \
    >"$LOGDIR/$name.log" 2>&1
  rc=$?
  CHECKS=$("$PY" - "$CHECKS" "$name" "$rc" "$(( $(date +%s) - t0 ))" "$LOGDIR/$name.log" <<'PYEOF'
import json, sys
checks, name, rc, secs, log = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
tail = open(log, errors="replace").read()[-2000:]
why = "timed out" if rc in (124, 137) else ("" if rc == 0 else f"exit code {rc}")
checks.append({"name": name, "passed": rc == 0, "seconds": secs, "why": why or None, "log_tail": tail})
print(json.dumps(checks))
PYEOF
)
  echo "$name: rc=$rc"
}

G=tests/plugin_torch/test_gpu.py
run_check cpu_fake_streams 90 tests/plugin_torch/test_cuda_path.py
run_check nccl_one_rank 60 "$G::test_nccl_cuda_training_equals_plain_training"
run_check amp 60 "$G::test_amp_grad_scaler_on_the_synchronous_path_equals_plain_amp_on_cuda"
run_check tied_split 60 "$G::test_split_tied_embeddings_on_cuda_equal_plain_training"
run_check gloo_cuda_two_processes 90 "$G::test_two_processes_on_one_gpu_over_gloo_equal_the_averaged_reference"

write_summary "$CHECKS" ""
"$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["passed"] else 1)' "$SUMMARY"
