"""training.studies.rfa_spread: the measurement replays the run it measures, and round 1 of the RFA-limit setting
is past the geometric median's breakdown for this attack (docs/research/results.md, "RFA's measured limit")."""

import csv
import subprocess
import sys

import pytest

import tests

pytestmark = pytest.mark.slow


def test_round_one_measurement(tmp_path):
  out = tmp_path / 'e1_rfa'
  subprocess.run([sys.executable, '-m', 'training.studies.rfa_spread', '--rounds=1', f'--output={out}'],
                 cwd=tests.ROOT, check=True, capture_output=True, timeout=600)
  with open(f'{out}.csv') as f:
    (row,) = list(csv.DictReader(f))
  row = {k: float(v) for k, v in row.items()}
  # The aggregate the library applied is the NumPy replay's 3-pass smoothed Weiszfeld (float32 vs float64).
  assert row['check_rel_diff'] < 1e-4
  # Spread ratio above sqrt(1 - 2 rho) / rho = 1.118 at rho = 0.4: the geometric median points against m.
  assert row['spread_ratio'] > (1 - 2 * 0.4) ** 0.5 / 0.4
  assert row['gm_cos'] < 0 and row['pass3_cos'] < 0
  assert row['z_opt'] > 1  # ... without being the attack point itself.


def test_the_honest_run_measures_the_mean_it_applies(tmp_path):
  # The uncorrupted trajectory's clients build their datasets in the worker (the runner's default placement): the
  # study places them, and its replay of the clients' updates gives the mean the library applied.
  out = tmp_path / 'honest'
  subprocess.run([sys.executable, '-m', 'training.studies.rfa_spread', '--rounds=1', '--trajectory=honest',
                  f'--output={out}'], cwd=tests.ROOT, check=True, capture_output=True, timeout=600)
  with open(f'{out}.csv') as f:
    (row,) = list(csv.DictReader(f))
  assert float(row['check_rel_diff']) < 1e-4
