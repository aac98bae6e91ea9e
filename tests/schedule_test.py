"""tests/schedule.py: modules longest first by their recorded seconds, unknown ones first, each module kept whole."""

import dataclasses
import json
import os

import tests
from tests import schedule


@dataclasses.dataclass
class _Item:
  nodeid: str


def test_modules_run_longest_first_unknown_ones_before_all_and_each_in_its_own_order():
  items = [_Item(n) for n in ('a.py::t1', 'b.py::t1', 'a.py::t2', 'c.py::t1', 'd.py::t1', 'b.py::t2', 'e.py::t')]
  seconds = {'a.py': 5.0, 'b.py': 40.0, 'c.py': 5.0, 'e.py': 0.0}
  ordered = [item.nodeid for item in schedule.longest_first(items, seconds)]
  assert ordered == ['d.py::t1', 'b.py::t1', 'b.py::t2', 'a.py::t1', 'a.py::t2', 'c.py::t1', 'e.py::t']


def test_the_recorder_writes_each_modules_seconds(tmp_path):
  recorder = schedule.SecondsRecorder(str(tmp_path / 'seconds.json'))
  for nodeid, duration in (('x.py::a', 1.25), ('x.py::a', 0.5), ('y.py::b[1]', 2.0)):
    recorder.add(nodeid, duration)
  recorder.write()
  assert json.loads((tmp_path / 'seconds.json').read_text()) == {'x.py': 1.8, 'y.py': 2.0}
  assert schedule.load_seconds(str(tmp_path / 'seconds.json')) == {'x.py': 1.8, 'y.py': 2.0}
  assert schedule.load_seconds(str(tmp_path / 'none.json')) == {}


def test_the_recorded_modules_are_the_suites():
  recorded = schedule.load_seconds()
  assert recorded, schedule.SECONDS_FILE
  missing = [m for m in recorded if not os.path.isfile(os.path.join(tests.ROOT, m))]
  assert not missing, f'{missing}: gone from the suite; refresh {schedule.SECONDS_FILE} (tests/schedule.py says how)'
