"""The scalar argument checks of `tff_gma.checks`: what each accepts (and returns), what it refuses, and that
the message names the argument."""

import fractions
import math
import subprocess
import sys

import numpy as np
import pytest

from tff_gma import checks

_NOT_NUMBERS = [None, 'half', '1', [0.5], (1,), object(), 1j, np.array([1.0])]


def test_imports_no_tensorflow():
  # NumPy-only modules (tff_gma.data.partition, ...) use these checks; importing them must stay cheap.
  code = 'import sys, tff_gma.checks; print("tensorflow" in sys.modules)'
  assert subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        check=True).stdout.strip() == 'False'


# ---------------------------------------------------------------------------------------- check_positive_finite


@pytest.mark.parametrize('value, expected', [
    (1, 1.0), (0.5, 0.5), (1e-300, 1e-300), (1e300, 1e300), (np.float32(0.25), 0.25), (np.float64(2.0), 2.0),
    (np.int64(3), 3.0), (np.uint8(7), 7.0), (fractions.Fraction(1, 4), 0.25),
])
def test_check_positive_finite_accepts(value, expected):
  got = checks.check_positive_finite(value, 'step')
  assert type(got) is float and got == expected


@pytest.mark.parametrize('value', [
    0, 0.0, -0.0, -1, -1e-12, math.nan, math.inf, -math.inf, np.float32('nan'), np.float64('inf'), np.int64(0),
    True, False, np.bool_(True), *_NOT_NUMBERS,
])
def test_check_positive_finite_rejects(value):
  with pytest.raises(ValueError) as info:
    checks.check_positive_finite(value, 'my_bound')
  assert str(info.value) == f'my_bound must be a positive finite number, got {value!r}'


# ------------------------------------------------------------------------------------------- check_positive_int


@pytest.mark.parametrize('value', [1, 2, 10**20, np.int64(5), np.int32(1), np.uint8(255), np.int8(3)])
def test_check_positive_int_accepts(value):
  got = checks.check_positive_int(value, 'rounds')
  assert type(got) is int and got == value


@pytest.mark.parametrize('value', [
    0, -1, np.int64(0), np.int32(-3), True, False, np.bool_(True), np.bool_(False), 1.0, 2.5, np.float32(3.0),
    math.nan, math.inf, *_NOT_NUMBERS,
])
def test_check_positive_int_rejects(value):
  with pytest.raises(ValueError) as info:
    checks.check_positive_int(value, 'my_count')
  assert str(info.value) == f'my_count must be a positive integer, got {value!r}'


def test_check_positive_int_optional():
  assert checks.check_positive_int(None, 'my_count', optional=True) is None
  got = checks.check_positive_int(np.int64(4), 'my_count', optional=True)
  assert type(got) is int and got == 4
  for value in (0, -2, True, np.bool_(True), 1.5, 'x'):
    with pytest.raises(ValueError) as info:
      checks.check_positive_int(value, 'my_count', optional=True)
    assert str(info.value) == f'my_count must be None or a positive integer, got {value!r}'
  with pytest.raises(ValueError, match='my_count must be a positive integer, got None'):
    checks.check_positive_int(None, 'my_count')


# ----------------------------------------------------------------------------------------------- check_fraction


@pytest.mark.parametrize('value,kwargs,expected', [
    (0, {}, 0.0), (1, {}, 1.0), (0.25, {}, 0.25), (np.float32(0.5), {}, 0.5), (np.int64(1), {}, 1.0),
    (1, dict(low_open=True), 1.0), (0, dict(high_open=True), 0.0), (0.5, dict(low_open=True, high_open=True), 0.5),
    (1e-12, dict(low_open=True), 1e-12), (-0.0, {}, 0.0),
])
def test_check_fraction_accepts(value, kwargs, expected):
  got = checks.check_fraction(value, 'f', **kwargs)
  assert type(got) is float and got == expected


@pytest.mark.parametrize('value,kwargs,interval', [
    (0, dict(low_open=True), '(0, 1]'), (1, dict(high_open=True), '[0, 1)'),
    (0.0, dict(low_open=True, high_open=True), '(0, 1)'), (1.0, dict(low_open=True, high_open=True), '(0, 1)'),
    (-0.0, dict(low_open=True), '(0, 1]'), (-1e-9, {}, '[0, 1]'), (1.000001, {}, '[0, 1]'),
    (math.nan, {}, '[0, 1]'), (np.float32('nan'), dict(low_open=True), '(0, 1]'),
    (math.inf, {}, '[0, 1]'), (-math.inf, {}, '[0, 1]'),
    (True, {}, '[0, 1]'), (False, {}, '[0, 1]'), (np.bool_(True), {}, '[0, 1]'),
])
def test_check_fraction_rejects_out_of_interval(value, kwargs, interval):
  with pytest.raises(ValueError) as info:
    checks.check_fraction(value, 'my_rate', **kwargs)
  assert str(info.value).startswith(f'my_rate must lie in {interval}, got ')


@pytest.mark.parametrize('value', _NOT_NUMBERS)
def test_check_fraction_rejects_non_numbers(value):
  with pytest.raises(ValueError, match=r'my_rate must be a number in \[0, 1\]'):
    checks.check_fraction(value, 'my_rate')


def test_check_fraction_says_a_bool_is_not_a_number():
  with pytest.raises(ValueError, match=r'my_rate must lie in \[0, 1\), got True \(a bool, not a number\)'):
    checks.check_fraction(True, 'my_rate', high_open=True)


# --------------------------------------------------------------------------------------------------- check_bool


@pytest.mark.parametrize('value, expected', [(True, True), (False, False), (np.bool_(True), True),
                                             (np.bool_(False), False)])
def test_check_bool_accepts(value, expected):
  got = checks.check_bool(value, 'secure')
  assert type(got) is bool and got is expected


@pytest.mark.parametrize('value', [
    0, 1, 0.0, 1.0, np.int64(1), np.float32(0.0), math.nan, 'True', 'false', *_NOT_NUMBERS,
])
def test_check_bool_rejects(value):
  with pytest.raises(ValueError) as info:
    checks.check_bool(value, 'my_flag')
  assert str(info.value) == f'my_flag must be a bool, got {value!r}'
