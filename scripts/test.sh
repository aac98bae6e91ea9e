#!/usr/bin/env bash
# Runs the whole test suite (sets up .venv first if needed). Extra arguments go to pytest.
# In $TFF_GMA_TEST_PROCESSES processes (default 2; pytest-xdist), a test module's tests in one of them: a single
# pytest process keeps about one core busy, since most tests wait on the TFF worker or a child. The modules go out
# longest first (tests/schedule.py), not in xdist's order (most tests first).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" pytest -n "${TFF_GMA_TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder "$@"
