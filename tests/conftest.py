"""Test set-up: quiet TF logs, one TFF simulation context (and worker) for the whole session, the slow tier."""

import inspect
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import pytest  # pylint: disable=g-import-not-at-top

# A test that trains through the runner or starts processes is end-to-end: it joins the `slow` tier even without
# an explicit marker, so that `-m "not slow"` stays a fast tier as tests are added.
_END_TO_END_CALLS = ('experiment.run(', 'subprocess.run(', 'subprocess.Popen(', 'start_local_workers(')


def pytest_collection_modifyitems(items):
  for item in items:
    function = getattr(item, 'function', None)
    if function is None or 'slow' in item.keywords:
      continue
    try:
      source = inspect.getsource(function)
    except (OSError, TypeError):
      continue
    if any(call in source for call in _END_TO_END_CALLS):
      item.add_marker(pytest.mark.slow)


@pytest.fixture(scope='session', autouse=True)
def simulation_context():
  """Every test runs against tff_gma's simulation context (secure intrinsics supported)."""
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  worker = runtime.set_simulation_context()
  yield worker
  runtime.shutdown()
