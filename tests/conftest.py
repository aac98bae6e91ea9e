"""Test set-up: quiet TF logs, one TFF simulation context (and worker) for the whole session."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import pytest  # pylint: disable=g-import-not-at-top


@pytest.fixture(scope='session', autouse=True)
def simulation_context():
  """Every test runs against tff_gma's simulation context (secure intrinsics supported)."""
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  worker = runtime.set_simulation_context()
  yield worker
  runtime.shutdown()
