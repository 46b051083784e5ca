#!/usr/bin/env bash
# Build Horovod 0.28.1 once per machine, cache the wheel, install it into the venv.
#
# Horovod's last release ships only an sdist that no longer builds as-is against
# torch >= 2.1 and CMake >= 4, and a build takes minutes on 2 cores. So:
#   1. fingerprint = python tag + arch + torch/tensorflow/mxnet versions in the
#      venv + hash of scripts/horovod_recipe.sh (patches and build flags);
#   2. venv already has that build installed (stamp)  -> nothing to do;
#   3. wheel for that fingerprint in the cache         -> pip install it (seconds);
#   4. otherwise download the sdist, patch, `pip wheel`, cache, install, verify.
#
# Environment:
#   VENV             venv to use (default: <repo>/.venv)
#   COMMSCHED_CACHE  cache root (default: $HOME/.cache/commsched); wheels go to
#                    $COMMSCHED_CACHE/wheels/<fingerprint>/, logs to .../logs/
#   HOROVOD_BUILD_JOBS  parallel compile jobs (default 2)
#   FORCE=1          rebuild even if a cached wheel exists
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RECIPE="$ROOT/scripts/horovod_recipe.sh"
# shellcheck source=scripts/horovod_recipe.sh
. "$RECIPE"  # HOROVOD_VERSION, horovod_patch, horovod_build_env
VENV=$(realpath -m "${VENV:-$ROOT/.venv}")
PY=$VENV/bin/python
CACHE=${COMMSCHED_CACHE:-$HOME/.cache/commsched}
JOBS=${HOROVOD_BUILD_JOBS:-2}

say() { echo "[build_horovod] $*"; }
die() { echo "[build_horovod] ERROR: $*" >&2; exit 1; }

[ -x "$PY" ] || die "no venv at $VENV (run 'make venv' first)"

# Versions from package metadata only: importing the frameworks costs seconds.
FP_PARTS=$("$PY" - <<'EOF'
import platform, sys
from importlib import metadata

def ver(*names):
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return "none"

print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
      f"-torch{ver('torch')}-tf{ver('tensorflow-cpu', 'tensorflow')}-mx{ver('mxnet')}")
EOF
)
RECIPE_HASH=$(sha256sum "$RECIPE" | cut -c1-10)
FINGERPRINT="horovod-${HOROVOD_VERSION}-${FP_PARTS}-${RECIPE_HASH}"
WHEEL_DIR="$CACHE/wheels/$FINGERPRINT"
STAMP="$VENV/.stamp-horovod"

case "$FP_PARTS" in *-torchnone-*) die "torch is not installed in $VENV; Horovod is built for torch (run 'make venv')";; esac

installed_version() { "$PY" -c 'from importlib import metadata; print(metadata.version("horovod"))' 2>/dev/null || true; }

if [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$FINGERPRINT" ] \
   && [ "$(installed_version)" = "$HOROVOD_VERSION" ]; then
  say "up to date: $FINGERPRINT"
  exit 0
fi

# Build and runtime dependencies of the wheel (setup.py needs them at build time
# too, and --no-build-isolation means nobody else installs them).
mkdir -p "$WHEEL_DIR" "$CACHE/logs" "$CACHE/sdist"
DEPS_LOG="$CACHE/logs/$FINGERPRINT.deps.log"
"$PY" -m pip install --disable-pip-version-check -c "$ROOT/requirements/constraints.txt" \
  -r "$ROOT/requirements/horovod.txt" >"$DEPS_LOG" 2>&1 \
  || { tail -n 20 "$DEPS_LOG" >&2; die "step 'install build dependencies' failed (log: $DEPS_LOG)"; }

# One builder per cache entry at a time; a second caller waits, then finds the wheel.
exec 9>"$WHEEL_DIR.lock"
if ! flock -n 9; then
  say "another process is building $FINGERPRINT; waiting for it"
  flock 9
fi

find_wheel() { compgen -G "$WHEEL_DIR/horovod-$HOROVOD_VERSION-*.whl" | head -n1 || true; }

verify() {  # quick check in a neutral cwd: the extension loads and init works
  local log=$1
  (cd / && "$PY" - >>"$log" 2>&1 <<'EOF'
import horovod.torch as hvd
hvd.init()
assert hvd.size() == 1, hvd.size()
hvd.shutdown()
print("verify: horovod.torch init ok")
EOF
  ) || { tail -n 20 "$log" >&2; die "step 'verify' failed: 'import horovod.torch; hvd.init()' (log: $log)"; }
}

install_wheel() {
  local whl=$1 log=$2
  "$PY" -m pip install --no-deps --force-reinstall "$whl" >>"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; die "step 'install wheel' failed for $whl (log: $log)"; }
  verify "$log"
  echo "$FINGERPRINT" >"$STAMP"
}

WHL=$(find_wheel)
if [ -n "$WHL" ] && [ "${FORCE:-0}" != 1 ]; then
  LOG="$CACHE/logs/$FINGERPRINT.install.log"
  : >"$LOG"
  t0=$(date +%s)
  install_wheel "$WHL" "$LOG"
  say "installed cached wheel $(basename "$WHL") in $(( $(date +%s) - t0 )) s (cache: $WHEEL_DIR)"
  exit 0
fi

# ---- build ---------------------------------------------------------------
LOG="$CACHE/logs/$FINGERPRINT.build.log"
: >"$LOG"
say "building Horovod $HOROVOD_VERSION for $FP_PARTS (takes minutes; log: $LOG)"
t0=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/commsched-horovod.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT
fail() {  # step name; keeps the log, prints its tail
  tail -n 40 "$LOG" >&2 || true
  die "step '$1' failed after $(( $(date +%s) - t0 )) s; full log: $LOG"
}

step() { echo "=== $* ($(date -u +%H:%M:%S))" >>"$LOG"; say "$*"; }

step "download sdist"
SDIST="$CACHE/sdist/horovod-$HOROVOD_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$WORK/dl" >>"$LOG" 2>&1 \
    || fail "download sdist"
  mv "$WORK/dl/horovod-$HOROVOD_VERSION.tar.gz" "$SDIST" || fail "download sdist"
fi

step "unpack"
# A broken cached sdist is removed so that the next run downloads it again.
tar -xzf "$SDIST" -C "$WORK" >>"$LOG" 2>&1 || { rm -f "$SDIST"; fail "unpack (cached sdist removed; rerun downloads it)"; }
SRC="$WORK/horovod-$HOROVOD_VERSION"

imports() { (cd / && "$PY" -c "import $1" >>"$LOG" 2>&1); }

step "choose frameworks"
horovod_build_env
say "frameworks: $FW"
echo "frameworks: $FW" >>"$LOG"

step "patch"
horovod_patch

step "cmake"
need_cmake=1
if command -v cmake >/dev/null 2>&1; then
  cv=$(cmake --version | sed -nE '1s/.*version ([0-9]+)\.([0-9]+).*/\1 \2/p')
  if [ -n "$cv" ] && [ "$(echo "$cv" | awk '{print ($1>3 || ($1==3 && $2>=13))}')" = 1 ]; then need_cmake=0; fi
fi
if [ $need_cmake = 1 ]; then
  # CMake from PyPI into the build dir only (not the venv).
  "$PY" -m pip install --quiet --target "$WORK/cmake" "cmake==3.31.10" >>"$LOG" 2>&1 || fail "install cmake from PyPI"
  mkdir -p "$WORK/bin"
  printf '#!/bin/sh\nPYTHONPATH=%s exec %s "$@"\n' "$WORK/cmake" "$WORK/cmake/bin/cmake" >"$WORK/bin/cmake"
  chmod +x "$WORK/bin/cmake"
  export PATH="$WORK/bin:$PATH"
fi
cmake --version | head -n1 >>"$LOG"

step "compile (pip wheel, -j$JOBS)"
export MAKEFLAGS="-j$JOBS"
# Put the venv first on PATH: horovod's CMake runs `python` to locate frameworks.
(cd "$WORK" && PATH="$VENV/bin:$PATH" nice -n 10 "$PY" -m pip wheel --no-build-isolation --no-deps -v \
   -w "$WORK/wheelhouse" "$SRC") >>"$LOG" 2>&1 || fail "compile (pip wheel)"
BUILT=$(compgen -G "$WORK/wheelhouse/horovod-*.whl" | head -n1 || true)
[ -n "$BUILT" ] || fail "compile (pip wheel): no wheel produced"

step "cache"
{ echo "fingerprint: $FINGERPRINT"; echo "frameworks: $FW"; echo "built: $(date -u +%FT%TZ) in $(( $(date +%s) - t0 )) s"; } \
  >"$WORK/wheelhouse/BUILD-INFO.txt"
cp "$WORK/wheelhouse/BUILD-INFO.txt" "$WHEEL_DIR/" || fail "cache"
cp "$BUILT" "$WHEEL_DIR/.$(basename "$BUILT").part" && mv "$WHEEL_DIR/.$(basename "$BUILT").part" "$WHEEL_DIR/$(basename "$BUILT")" \
  || fail "cache"

step "install + verify"
install_wheel "$WHEEL_DIR/$(basename "$BUILT")" "$LOG"
say "built and installed in $(( $(date +%s) - t0 )) s: $WHEEL_DIR/$(basename "$BUILT") ($FW)"
