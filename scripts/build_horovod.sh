#!/usr/bin/env bash
# Builds Horovod 0.28.1 for this project's torch (>= 2.1) and installs it into the venv.
#
# Why: the published sdist asks CMake for C++14 while torch >= 2.1 headers need C++17, so
# `pip install horovod` fails. We patch the two CMake files, build a wheel once with Gloo only
# (no MPI/TF/MXNet), cache it outside the work tree keyed by torch version, and reuse it after.
set -euo pipefail

PY=${PY:-.venv/bin/python}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
CACHE=${FABRIC_HOROVOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fabric-torch/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION}

if "$PY" -c 'import horovod.torch' 2>/dev/null; then
    echo "horovod already installed in $("$PY" -c 'import sys; print(sys.prefix)')"
    exit 0
fi

wheel=$(ls "$CACHE"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    echo "building horovod $HOROVOD_VERSION against torch $TORCH_VERSION (about 5 minutes on 2 cores)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
    # The build imports torch, so it runs in the venv rather than an isolated build env.
    "$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
    mkdir -p "$CACHE"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel -q --no-deps --no-build-isolation "$src" -w "$CACHE"
    wheel=$(ls "$CACHE"/horovod-*.whl | head -n 1)
fi
"$PY" -m pip install -q --no-deps "$wheel"
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
"$PY" -c 'import horovod.torch as hvd; print("horovod", __import__("horovod").__version__, "gloo built:", hvd.gloo_built())'
