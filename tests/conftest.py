"""Test set-up: quiet TF logs, one TFF simulation context (and worker) for the whole session, the slow tier, the
modules longest first (`tests/schedule.py`)."""

import inspect
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import pytest  # pylint: disable=g-import-not-at-top

from tests import schedule  # pylint: disable=g-import-not-at-top

# A test that trains through the runner or starts processes (itself, through a function of its module, or through a
# fixture) is end-to-end: it joins the `slow` tier even without an explicit marker, so that `-m "not slow"` stays a
# fast tier as tests are added.
_END_TO_END_CALLS = ('experiment.run(', 'subprocess.run(', 'subprocess.Popen(', 'start_local_workers(',
                     'run_background_job(', 'run_on_tmpfs(')  # The last two: tests/ helpers that start processes.


def _source(function) -> str:
  try:
    return inspect.getsource(function)
  except (OSError, TypeError):
    return ''


def _starts_processes(source: str) -> bool:
  return any(call in source for call in _END_TO_END_CALLS)


def _process_helpers(module) -> tuple[str, ...]:
  """`name(` for each function of a test module that starts processes, itself or through another such function of
  the module (a test calling one is end-to-end too)."""
  sources = {name: _source(value) for name, value in vars(module).items()
             if inspect.isfunction(value) and value.__module__ == module.__name__}
  helpers = {name for name, source in sources.items() if _starts_processes(source)}
  while True:  # Whatever calls a helper is one.
    more = {name for name, source in sources.items() if name not in helpers
            and any(f'{helper}(' in source for helper in helpers)}
    if not more:
      return tuple(f'{name}(' for name in helpers)
    helpers |= more


def pytest_collection_modifyitems(items):
  _mark_end_to_end_tests_slow(items)
  items[:] = schedule.longest_first(items, schedule.load_seconds())


def _mark_end_to_end_tests_slow(items):
  helpers = {}
  for item in items:
    function = getattr(item, 'function', None)
    if function is None or 'slow' in item.keywords:
      continue
    module = item.module
    if module.__name__ not in helpers:
      helpers[module.__name__] = _process_helpers(module)
    source = _source(function)
    fixtures = [_source(d.func) for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]  # pylint: disable=protected-access
    if (_starts_processes(source) or any(call in source for call in helpers[module.__name__])
        or any(_starts_processes(f) for f in fixtures)):
      item.add_marker(pytest.mark.slow)


_RECORDER = schedule.SecondsRecorder(os.environ[schedule.RECORD_ENV]) if os.environ.get(schedule.RECORD_ENV) else None


def pytest_runtest_logreport(report):
  if _RECORDER is not None:  # Under xdist, the controlling process sees every worker's reports.
    _RECORDER.add(report.nodeid, report.duration)


def pytest_sessionfinish(session):
  if _RECORDER is not None and not hasattr(session.config, 'workerinput'):  # The controller (or a plain run).
    _RECORDER.write()


@pytest.fixture(scope='session', autouse=True)
def simulation_context():
  """Every test runs against tff_gma's simulation context (secure intrinsics supported)."""
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  worker = runtime.set_simulation_context()
  yield worker
  runtime.shutdown()
