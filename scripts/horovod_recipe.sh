# Sourced by scripts/build_horovod.sh: WHAT is built (patches to the Horovod
# sdist and the build environment). The cache key of the wheel includes the
# hash of this file, so any change here rebuilds; changes to the driver script
# (caching, logging) do not.
# Expects: SRC (unpacked sdist), PY (venv python), LOG, fail() and imports().

HOROVOD_VERSION=0.28.1

horovod_patch() {
  # patch FILE SED-EXPR CHECK-REGEX: apply, and insist that the result is there.
  _patch() {
    local f="$SRC/$1"
    sed -i -E "$2" "$f" >>"$LOG" 2>&1 || fail "patch $1"
    grep -Eq "$3" "$f" || { echo "patch did not apply: $1: $2" >>"$LOG"; fail "patch $1"; }
  }
  # torch >= 2.1 headers need C++17.
  _patch CMakeLists.txt 's/set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD 17)/' \
    '^set\(CMAKE_CXX_STANDARD 17\)'
  _patch horovod/torch/CMakeLists.txt 's/set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD 17)/' \
    'set\(CMAKE_CXX_STANDARD 17\)'
  if grep -q 'set(CMAKE_CXX_STANDARD 14)' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; then
    fail "patch (C++14 left)"
  fi
  # CMake 4 (PyPI) refuses cmake_minimum_required below 3.5.
  _patch third_party/gloo/CMakeLists.txt \
    's/cmake_minimum_required\(VERSION 2\.8\.12/cmake_minimum_required(VERSION 3.5/' \
    'cmake_minimum_required\(VERSION 3\.5'
  # xla_mpi_ops.cc is GPU-only and does not compile against TF 2.21 on CPU.
  if [ "${HOROVOD_WITH_TENSORFLOW:-0}" = 1 ]; then
    sed -i '/xla_mpi_ops\.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt" \
      || fail "patch horovod/tensorflow/CMakeLists.txt"
  fi
}

# Sets HOROVOD_* for the build; FW lists the frameworks built in.
horovod_build_env() {
  imports torch || fail "choose frameworks: 'import torch' fails in the venv"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo
  FW="torch"
  # TensorFlow and MXNet go in only where they import in this venv.
  if imports tensorflow; then export HOROVOD_WITH_TENSORFLOW=1; FW="$FW tensorflow"
  else export HOROVOD_WITHOUT_TENSORFLOW=1; fi
  if imports mxnet; then export HOROVOD_WITH_MXNET=1; FW="$FW mxnet"
  else export HOROVOD_WITHOUT_MXNET=1; fi
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
}
