#!/usr/bin/env bash
# Install everything hvd_scalecom needs into a virtual environment, idempotently.
#
#   scripts/install.sh            # CPU build into ./.venv (what `make demo` / `make test` call)
#   HVD_SCALECOM_GPU=1 scripts/install.sh   # CUDA build (docker/Dockerfile.gpu)
#
# Environment:
#   VENV                 where the virtual environment lives (default: <repo>/.venv)
#   HVD_SCALECOM_CACHE   where built Horovod wheels are cached (default: ~/.cache/hvd_scalecom)
#   HVD_SCALECOM_GPU     1 for a CUDA build (tensorflow instead of tensorflow-cpu, NCCL operations)
#   HVD_SCALECOM_JOBS    parallel jobs of the Horovod build (default: 2)
#
# Horovod (HOROVOD_VERSION) does not build as released against torch >= 2.1 and TF >= 2.19; two fixes are
# applied to the unpacked source distribution at build time (see patch_horovod_source below).
# The build (minutes) happens once: the wheel is cached outside the repository, keyed by the
# Horovod, torch, TensorFlow and Python versions and the build variant, and reused afterwards while
# the build's recipe (the patches and flags below) is the one it was built by.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

VENV="$(realpath -ms "${VENV:-$repo/.venv}")"  # (absolute: the venv's scripts name it)
CACHE="${HVD_SCALECOM_CACHE:-$HOME/.cache/hvd_scalecom}"
GPU="${HVD_SCALECOM_GPU:-0}"
if [ "$GPU" = 1 ]; then variant=gpu; tf_pkg=tensorflow; else variant=cpu; tf_pkg=tensorflow-cpu; fi
stamp="$VENV/.hvd_scalecom-install-stamp"
# (the checkout and the venv too: another checkout must install itself, and a moved venv is remade)
stamp_key="$({ cat "$here/versions.env" "$here/install.sh"; echo "$repo"; echo "$VENV"; } | sha256sum | cut -c1-16)-$variant"

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

# the top-level modules the steps below install (a package uninstalled since is installed again)
MODULES="torch tensorflow numpy mpi4py sklearn pytest matplotlib tensorboard tqdm ruff horovod hvd_scalecom"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_key" ] && [ -x "$VENV/bin/horovodrun" ] \
   && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
        $MODULES 2>/dev/null; then
  exit 0   # everything below already done with these exact versions, here
fi

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else die "need root (or sudo) to run: $*"; fi
}

py="python$PYTHON_VERSION"
command -v "$py" >/dev/null || py=python3
venv_usable() {  # made here, with pip: its scripts (pip's, horovodrun) start with this path's python
  [ -x "$VENV/bin/python" ] && [ -f "$VENV/bin/pip" ] && head -n 1 "$VENV/bin/pip" | grep -qF "#!$VENV/bin/python"
}

# 1. System packages: OpenMPI (so Horovod gets the MPI controller), a compiler and cmake; and
#    Debian's venv module where the Python that makes the venv lacks ensurepip.
need_apt=()
for pkg in libopenmpi-dev openmpi-bin cmake g++ make; do
  # installed ("ii"), not merely known to dpkg (a package removed but not purged is "rc")
  dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null | grep -q '^ii' || need_apt+=("$pkg")
done
if ! venv_usable && ! "$py" -c "import ensurepip" 2>/dev/null; then
  need_apt+=("python$PYTHON_VERSION-venv")
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing system packages: ${need_apt[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# 2. The virtual environment and the frameworks (Horovod compiles against these exact versions).
if [ -e "$VENV" ] && ! venv_usable; then
  # moved from elsewhere (its scripts name the old path) or made without pip: made again
  [ -f "$VENV/pyvenv.cfg" ] || [ -z "$(ls -A "$VENV" 2>/dev/null)" ] \
    || die "VENV=$VENV exists and is not a virtual environment; remove it or choose another"
  log "$VENV was made elsewhere or without pip (its scripts would not run here): making it again"
  rm -rf "$VENV"
fi
if [ ! -e "$VENV" ]; then
  "$py" -c "import sys; sys.exit(not sys.version.startswith('$PYTHON_VERSION'))" 2>/dev/null \
    || die "Python $PYTHON_VERSION is needed (the frameworks and Horovod are pinned for it): no python$PYTHON_VERSION on PATH, and $py is $("$py" -V 2>&1); install it (e.g. apt-get install python$PYTHON_VERSION python$PYTHON_VERSION-venv) and retry"
  log "creating $VENV"
  "$py" -m venv "$VENV" || { rm -rf "$VENV"; die "$py -m venv failed (above); nothing was left at $VENV"; }
fi
vpy="$VENV/bin/python"
"$vpy" -c "import sys; assert sys.version.startswith('$PYTHON_VERSION'), sys.version" \
  || die "$VENV uses $("$vpy" -V), expected Python $PYTHON_VERSION; remove $VENV and retry"
pip_install() {  # quiet, minus pip's notes about this machine's unused local index folders
  "$vpy" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}
# tensorflow and tensorflow-cpu install the same module: the other build's package goes first, and
# this one's files are put back whole (the uninstall removed the files the two share).
if [ "$GPU" = 1 ]; then other_tf=tensorflow-cpu; else other_tf=tensorflow; fi
if "$vpy" -m pip show -q "$other_tf" >/dev/null 2>&1; then
  log "removing $other_tf (this is the $variant build: $tf_pkg)"
  "$vpy" -m pip uninstall -y -q "$other_tf"
  pip_install --no-deps --force-reinstall "$tf_pkg==$TENSORFLOW_VERSION"
fi
log "installing Python packages (torch $TORCH_VERSION, $tf_pkg $TENSORFLOW_VERSION, ...)"
pip_install "torch==$TORCH_VERSION" "$tf_pkg==$TENSORFLOW_VERSION" "$NUMPY_SPEC" \
  "mpi4py==$MPI4PY_VERSION" "scikit-learn==$SCIKIT_LEARN_VERSION" "$PYTEST_SPEC" "$MATPLOTLIB_SPEC" \
  "$TENSORBOARD_SPEC" "$TQDM_SPEC" "ruff==$RUFF_VERSION" \
  cloudpickle psutil pyyaml packaging cffi wheel setuptools

# 3. Horovod, from the cached wheel when one matches, else built once from the sdist.
torch_v="$("$vpy" -c 'import torch; print(torch.__version__)')"
tf_v="$("$vpy" -c 'import importlib.metadata as m; print(m.version("'"$tf_pkg"'"))')"
py_v="$("$vpy" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
key="horovod${HOROVOD_VERSION}-torch${torch_v}-tf${tf_v}-${py_v}-${variant}-gloo-mpi"
wheel_dir="$CACHE/$key"

patch_horovod_source() {  # $1: unpacked sdist
  local src="$1"
  # torch >= 2.1 headers need C++17; the release pins C++14 (fixed upstream after the release).
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  # TF >= 2.19 moved the XLA headers that xla_mpi_ops.cc includes; the file only holds the optional
  # XLA custom-call ops (HOROVOD_ENABLE_XLA_OPS), so it is compiled empty.
  sed -i 's/^#if TENSORFLOW_VERSION >= 2006000000$/#if 0 \/\/ hvd_scalecom: XLA ops disabled (moved headers in TF >= 2.19)/' \
    "$src/horovod/tensorflow/xla_mpi_ops.cc"
  grep -q 'CMAKE_CXX_STANDARD 14' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" \
    && die "C++17 patch did not apply"
  grep -q '^#if 0 // hvd_scalecom' "$src/horovod/tensorflow/xla_mpi_ops.cc" || die "XLA patch did not apply"
}

build_horovod_wheel() {  # $1: patched sdist, $2: where the wheel goes; the build's output on stdout
  ( cd "$1" \
    && export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
              HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j${HVD_SCALECOM_JOBS:-2}" \
              CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    && if [ "$GPU" = 1 ]; then export HOROVOD_GPU_OPERATIONS=NCCL; fi \
    && PATH="$VENV/bin:$PATH" "$vpy" -m pip wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$2" . ) 2>&1
  # (CMAKE_POLICY_VERSION_MINIMUM: a CMake 4 first on PATH refuses the release's old minimum)
}

# The recipe a cached wheel was built by: another patch or flag (not a comment) builds anew. A wheel
# cached before recipes were recorded is taken as this recipe's (those before differ only in flags
# that change no CPU build: the CMake policy minimum, the parallel jobs).
recipe="$(declare -f patch_horovod_source build_horovod_wheel | sha256sum | cut -c1-16)"
if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 && [ ! -f "$wheel_dir/recipe" ]; then
  echo "$recipe" > "$wheel_dir/recipe"
fi
if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 && [ "$(cat "$wheel_dir/recipe")" != "$recipe" ]; then
  log "the cached wheel in $wheel_dir was built by another recipe (patches or flags): building anew"
  rm -rf "$wheel_dir"
fi

has_python_headers() {  # the build compiles against Python.h (torch's extension headers include it)
  "$vpy" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"
}

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  if ! has_python_headers; then
    log "installing python$PYTHON_VERSION-dev (Horovod's build needs Python.h)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "python$PYTHON_VERSION-dev" >/dev/null || true
    has_python_headers || die "Horovod's build needs Python.h, which is not in $("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["include"])'): install the development headers of the Python that made $VENV (python$PYTHON_VERSION-dev for Debian's) and retry"
  fi
  log "building Horovod $HOROVOD_VERSION ($key): several minutes, once"
  build="$(mktemp -d)"
  trap 'rm -rf "$build"' EXIT
  "$vpy" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }
  tar -xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
  patch_horovod_source "$build/horovod-$HOROVOD_VERSION"
  build_horovod_wheel "$build/horovod-$HOROVOD_VERSION" "$build/wheel" > "$build/build.log" \
    || { tail -n 60 "$build/build.log" >&2; die "Horovod build failed (log above)"; }
  # Filled whole or not at all: a copy cut short must not pass for a cached wheel later.
  rm -rf "$wheel_dir.partial" && mkdir -p "$wheel_dir.partial" "$(dirname "$wheel_dir")"
  cp "$build"/wheel/horovod-*.whl "$wheel_dir.partial/"
  echo "$recipe" > "$wheel_dir.partial/recipe"
  rm -rf "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"
  log "cached $(ls "$wheel_dir"/horovod-*.whl)"
fi
# Installed again whenever the wheel installed last was built for other versions, another variant
# or by another recipe.
installed_key="$VENV/.hvd_scalecom-horovod-wheel"
if ! "$vpy" -c "import importlib.metadata as m, sys; sys.exit(m.version('horovod') != '$HOROVOD_VERSION')" 2>/dev/null \
   || [ "$(cat "$installed_key" 2>/dev/null)" != "$key-$recipe" ]; then
  log "installing Horovod built for $key (recipe $recipe)"
  pip_install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  echo "$key-$recipe" > "$installed_key"
fi

# 4. The package itself (editable), then the check the issue asks for.
pip_install --no-deps --no-build-isolation -e "$repo"
check="$("$VENV/bin/horovodrun" --check-build 2>&1)" || { echo "$check" >&2; die "horovodrun --check-build failed"; }
for want in "\[X\] TensorFlow" "\[X\] PyTorch" "\[X\] MPI" "\[X\] Gloo"; do
  grep -q "$want" <<<"$check" || { echo "$check" >&2; die "horovodrun --check-build lacks ${want#'\[X\] '}"; }
done
log "horovodrun --check-build: TensorFlow, PyTorch, MPI and Gloo present"
echo "$stamp_key" > "$stamp"
