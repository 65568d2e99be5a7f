#!/usr/bin/env bash
# Builds Horovod 0.28.1 for this project's torch (>= 2.1) and installs it into the venv.
#
# Why: the published sdist asks CMake for C++14 while torch >= 2.1 headers need C++17, so
# `pip install horovod` fails. We patch the two CMake files, build a wheel once with Gloo only
# (no MPI/TF/MXNet), cache it outside the work tree keyed by Horovod, torch and Python versions,
# and reuse it after. Idempotent: a working install is left alone; a broken one (e.g. built
# against another torch) is replaced. Any failure stops the script with a message saying what failed.
#
# Environment: PY (default .venv/bin/python), FABRIC_HOROVOD_CACHE (the wheel cache folder),
# FABRIC_HOROVOD_REBUILD=1 (build again even if Horovod works or a wheel is cached).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
HOROVOD_VERSION=0.28.1
RUNTIME_DEPS=(cloudpickle psutil pyyaml packaging cffi numpy)
PIP_CONSTRAINTS=()
if [ -f constraints.txt ]; then
    PIP_CONSTRAINTS=(-c constraints.txt)  # never let a dependency move torch
fi

fail() {
    echo "build_horovod.sh: error: $*" >&2
    exit 1
}
trap 'echo "build_horovod.sh: error: \"$BASH_COMMAND\" failed (line $LINENO); see the output above" >&2' ERR

[ -x "$PY" ] || fail "no Python at $PY; create the venv first (make venv) or set PY=/path/to/python"
"$PY" -c 'import torch' 2>/dev/null || fail "torch is not installed in $PY's environment; run make venv first"

# The check that counts: the compiled extension loads against this torch and can run collectives.
check_installed() {
    "$PY" - <<'EOF' 2>/dev/null
import horovod.torch as hvd
assert hasattr(hvd, "init") and hvd.gloo_built(), "horovod.torch loaded without its Gloo extension"
import numpy, cloudpickle  # broadcast_object needs both
import psutil, yaml, packaging  # horovodrun needs these
EOF
}

if [ "${FABRIC_HOROVOD_REBUILD:-0}" != 1 ] && check_installed; then
    echo "horovod $HOROVOD_VERSION already works in $("$PY" -c 'import sys; print(sys.prefix)'); nothing to do"
    exit 0
fi

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
PY_TAG=$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
CACHE=${FABRIC_HOROVOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fabric-torch/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$PY_TAG}
mkdir -p "$CACHE"

# Two builds at once (parallel CI jobs) would race on the cache: take turns.
if command -v flock >/dev/null; then
    exec 9>"$CACHE/.lock"
    flock 9
fi

wheel=$(ls "$CACHE"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$wheel" ] && [ "${FABRIC_HOROVOD_REBUILD:-0}" = 1 ]; then
    rm -f "$wheel"
    wheel=""
fi
if [ -z "$wheel" ]; then
    for tool in cmake g++ make; do
        command -v "$tool" >/dev/null || fail "$tool is needed to build Horovod (Debian: apt-get install cmake g++ make)"
    done
    echo "building horovod $HOROVOD_VERSION against torch $TORCH_VERSION (5 to 10 minutes on 2 cores)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    for file in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$file"
        grep -q 'set(CMAKE_CXX_STANDARD 17)' "$file" || fail "could not switch $file to C++17; did the sdist change?"
    done
    # The build imports torch, so it runs in the venv rather than an isolated build environment.
    "$PY" -m pip install -q "${PIP_CONSTRAINTS[@]}" "${RUNTIME_DEPS[@]}"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel -q --no-deps --no-build-isolation "$src" -w "$work/dist"
    built=$(ls "$work"/dist/horovod-*.whl 2>/dev/null | head -n 1 || true)
    [ -n "$built" ] || fail "pip wheel finished but left no horovod wheel in $work/dist"
    # move into the cache in one step, so an interrupted build never leaves a half-written wheel there
    cp "$built" "$CACHE/.partial.whl"
    mv "$CACHE/.partial.whl" "$CACHE/$(basename "$built")"
    wheel="$CACHE/$(basename "$built")"
fi

"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" -m pip install -q "${PIP_CONSTRAINTS[@]}" "${RUNTIME_DEPS[@]}"
check_installed || fail "horovod was installed from $wheel but horovod.torch does not load; rebuild with FABRIC_HOROVOD_REBUILD=1"
"$PY" -c 'import horovod, horovod.torch as hvd; print("horovod", horovod.__version__, "installed; gloo built:", hvd.gloo_built())'
