#!/usr/bin/env bash
# Creates .venv/ at the repo root and installs the pinned dependencies and the project (editable).
# Idempotent: when requirements.txt and setup.py are unchanged since the last successful run, it only checks
# that the venv still imports and returns in a few seconds. Usage: scripts/setup.sh [--force]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.tff_gma_setup_stamp"
want="$(cat requirements.txt setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [[ "${1:-}" != "--force" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
   && "$venv/bin/python" -c 'import tff_gma' >/dev/null 2>&1; then
  exit 0
fi

# TFF 0.87.0 supports Python 3.9-3.11: take the newest such interpreter on PATH or under pyenv.
find_python() {
  local c
  for c in python3.11 python3.10 python3.9 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(not ((3, 9) <= sys.version_info[:2] <= (3, 11)))'; then
      command -v "$c"; return 0
    fi
  done
  for c in "$HOME"/.pyenv/versions/3.11.*/bin/python3 "$HOME"/.pyenv/versions/3.10.*/bin/python3 "$HOME"/.pyenv/versions/3.9.*/bin/python3; do
    [[ -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c 'import sys; sys.exit(not ((3, 9) <= sys.version_info[:2] <= (3, 11)))'; then
  py="$(find_python)" || { echo "setup.sh: no Python 3.9-3.11 found (TensorFlow Federated 0.87.0 needs one)" >&2; exit 1; }
  echo "setup.sh: creating .venv with $py" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
fi

pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
echo "setup.sh: installing pinned dependencies (first run: a few minutes)" >&2
# The registry's local mirrors print a warning per package they do not hold; they are noise.
"${pip[@]}" install -r requirements.txt 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2
# TFF pins jax/jaxlib 0.4.14, which the registry lacks; its other dependencies are in requirements.txt.
"${pip[@]}" install --no-deps tensorflow-federated==0.87.0 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2
"${pip[@]}" install --no-deps --no-build-isolation -e . 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2
TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "import tff_gma, tensorflow_federated" >/dev/null 2>&1 \
  || { echo "setup.sh: the installed environment does not import (run: .venv/bin/python -c \"import tensorflow_federated\")" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup.sh: .venv ready" >&2
