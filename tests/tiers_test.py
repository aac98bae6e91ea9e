"""tests/tiers.py: a case joins the fast tier exactly when some key shows a value no earlier case showed."""

import pytest

from tests import tiers


def _is_slow(param) -> bool:
  return any(mark.name == 'slow' for mark in param.marks)


def test_the_first_case_of_each_value_is_fast_and_the_rest_slow():
  cases = [('a', 1), ('a', 2), ('b', 1), ('b', 2), ('a', 1), ('c', 2)]
  params = tiers.cover_once(cases, keys=[lambda c: c[0], lambda c: c[1]])
  assert [p.values for p in params] == cases  # Every case kept, in order, as the test's arguments.
  assert [_is_slow(p) for p in params] == [False, False, False, True, True, False]


def test_one_value_cases_and_ids():
  params = tiers.cover_once([3, 4, 5], keys=[lambda c: c % 2], ids=lambda c: f'n{c}')
  assert [p.values for p in params] == [(3,), (4,), (5,)]
  assert [p.id for p in params] == ['n3', 'n4', 'n5']
  assert [_is_slow(p) for p in params] == [False, False, True]


@pytest.mark.parametrize('x, y', tiers.cover_once([(1, 2), (1, 2)], keys=[lambda c: c]))
def test_the_params_drive_a_multi_name_parametrize(x, y):
  assert (x, y) == (1, 2)


def test_first_only_keeps_the_first_case_fast():
  params = tiers.first_only(['a', 'b', 'c'])
  assert [p.values for p in params] == [('a',), ('b',), ('c',)]
  assert [_is_slow(p) for p in params] == [False, True, True]
