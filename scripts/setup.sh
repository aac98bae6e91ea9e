#!/usr/bin/env bash
# Creates .venv/ at the repo root and installs the pinned dependencies and the project (editable).
# Idempotent: when requirements.txt and setup.py are unchanged since the last successful run (and, with --gpu,
# that run installed the GPU libraries too), it only checks that the venv still imports and returns in a few
# seconds. Usage: scripts/setup.sh [--force] [--gpu]
#   --force  reinstall even when the stamp says the venv is up to date
#   --gpu    also install the CUDA libraries TensorFlow 2.14.1 loads at run time: the nvidia-*-cu11 wheels at the
#            exact pins of its `and-cuda` extra (not its tensorrt pin: TF-TRT is optional and that sdist fetches
#            from outside the registry). TensorFlow finds them in site-packages by its RPATH. Only the driver
#            process uses them (--client_execution=local): TFF's worker_binary has no GPU support (docs/runtime.md "GPU and client execution modes").
#   --data=fashion_mnist  also install Fashion-MNIST's original IDX files, Debian's package dataset-fashion-mnist
#            (into /usr/share/datasets/fashion-mnist/, where `--dataset=fashion_mnist` reads them): as root with
#            apt-get; otherwise it prints the command to run as root and exits 1.
# TFF_GMA_SETUP_DRY_RUN=1 prints the commands that would change the venv instead of running them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${TFF_GMA_SETUP_VENV:-$root/.venv}"  # Another venv directory: for the tests.
stamp="$venv/.tff_gma_setup_stamp"
force=0
gpu=0
data=
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    --gpu) gpu=1 ;;
    --data=fashion_mnist) data=fashion_mnist ;;
    --data=*) echo "setup.sh: unknown data set '${arg#--data=}' (--data=fashion_mnist is the one installed from Debian)" >&2; exit 2 ;;
    *) echo "setup.sh: unknown argument '$arg' (usage: scripts/setup.sh [--force] [--gpu] [--data=fashion_mnist])" >&2; exit 2 ;;
  esac
done
# TensorFlow 2.14.1's `and-cuda` extra (its METADATA Requires-Dist), tensorrt left out (see above).
gpu_packages=(
  nvidia-cuda-runtime-cu11==11.8.89 nvidia-cublas-cu11==11.11.3.6 nvidia-cufft-cu11==10.9.0.58
  nvidia-cudnn-cu11==8.7.0.84 nvidia-curand-cu11==10.3.0.86 nvidia-cusolver-cu11==11.4.1.48
  nvidia-cusparse-cu11==11.7.5.86 nvidia-nccl-cu11==2.16.5 nvidia-cuda-cupti-cu11==11.8.87
  nvidia-cuda-nvcc-cu11==11.8.89
)
dry_run="${TFF_GMA_SETUP_DRY_RUN:-0}"
# The stamp: the hash of what the install depends on, then ' gpu' when the GPU libraries were installed too.
files_hash="$(cat requirements.txt setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)"
want="$files_hash"
[[ $gpu == 1 ]] && want="$files_hash gpu"
have="$(cat "$stamp" 2>/dev/null || true)"

# Fashion-MNIST from Debian (before the venv's up-to-date check, which may end the script).
if [[ "$data" == fashion_mnist ]]; then
  fmnist_dir=/usr/share/datasets/fashion-mnist
  if [[ -f "$fmnist_dir/train-images-idx3-ubyte.gz" && -f "$fmnist_dir/t10k-labels-idx1-ubyte.gz" ]]; then
    :  # Installed.
  elif [[ "$(id -u)" != 0 ]]; then
    echo "setup.sh: Fashion-MNIST is not installed; as root, run: apt-get update && apt-get install -y dataset-fashion-mnist" >&2
    exit 1
  else
    echo "setup.sh: installing Debian's dataset-fashion-mnist into $fmnist_dir" >&2
    if [[ "$dry_run" == 1 ]]; then
      echo "setup.sh: would run: apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist"
    else
      apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
    fi
  fi
fi

# Up to date: the same files, and the GPU libraries if asked for (a GPU install also serves a plain run).
if [[ $force == 0 && ( "$have" == "$want" || "$have" == "$files_hash gpu" ) ]] \
   && "$venv/bin/python" -c 'import tff_gma' >/dev/null 2>&1; then
  exit 0
fi

# Runs a command that changes the venv, or prints it under TFF_GMA_SETUP_DRY_RUN=1.
run() {
  if [[ "$dry_run" == 1 ]]; then
    printf 'setup.sh: would run:'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

# Python 3.11 only (setup.py's python_requires, README "Install"): TFF 0.87.0 allows 3.9-3.11, but the pins in
# requirements.txt need 3.11. Take one on PATH or under pyenv.
is_py311='import sys; sys.exit(sys.version_info[:2] != (3, 11))'
find_python() {
  local c
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "$is_py311"; then
      command -v "$c"; return 0
    fi
  done
  for c in "$HOME"/.pyenv/versions/3.11.*/bin/python3; do
    [[ -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "$is_py311"; then
  py="$(find_python)" || { echo "setup.sh: no Python 3.11 found (the pinned set in requirements.txt needs it)" >&2; exit 1; }
  echo "setup.sh: creating .venv with $py" >&2
  run rm -rf "$venv"
  run "$py" -m venv "$venv"
fi

pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# The registry's local mirrors print a warning per package they do not hold; they are noise.
quiet() { { grep -v "^WARNING: Location 'file:" || true; } >&2; }
echo "setup.sh: installing pinned dependencies (first run: a few minutes)" >&2
run "${pip[@]}" install -r requirements.txt 2>&1 | quiet
# TFF pins jax/jaxlib 0.4.14, which the registry lacks; its other dependencies are in requirements.txt.
run "${pip[@]}" install --no-deps tensorflow-federated==0.87.0 2>&1 | quiet
# pyproject.toml (tool settings only) makes pip build through PEP 517, whose editable install would map tff_gma alone;
# editable_mode=compat keeps what `setup.py develop` installed: the checkout's root on sys.path (a .pth file).
run "${pip[@]}" install --no-deps --no-build-isolation --config-settings editable_mode=compat -e . 2>&1 | quiet
if [[ $gpu == 1 ]]; then
  echo "setup.sh: installing TensorFlow 2.14.1's CUDA 11.8 libraries (--gpu: about 3 GB)" >&2
  run "${pip[@]}" install --no-deps "${gpu_packages[@]}" 2>&1 | quiet
fi
if [[ "$dry_run" == 1 ]]; then
  exit 0
fi
TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "import tff_gma, tensorflow_federated" >/dev/null 2>&1 \
  || { echo "setup.sh: the installed environment does not import (run: .venv/bin/python -c \"import tensorflow_federated\")" >&2; exit 1; }
if [[ $gpu == 1 ]]; then
  gpus="$(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))" 2>/dev/null || echo '?')"
  echo "setup.sh: TensorFlow sees $gpus GPU(s) in this process (0: no driver or no GPU here; the libraries are installed)" >&2
fi
echo "$want" > "$stamp"
echo "setup.sh: .venv ready" >&2
