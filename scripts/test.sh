#!/usr/bin/env bash
# Runs the whole test suite (sets up .venv first if needed). Extra arguments go to pytest.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" pytest "$@"
