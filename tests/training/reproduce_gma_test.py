"""The reproduction scripts run end to end (at toy size) and write their tables and figures."""

import tests
import json
import os
import subprocess
import sys

_ROOT = tests.ROOT


def test_reproduce_gma_script_runs(tmp_path):
  out = tmp_path / 'gma'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  proc = subprocess.run(
      ['bash', os.path.join(_ROOT, 'scripts', 'reproduce_gma.sh'), '--seeds=0,1', '--rounds=1',
       '--partitions=label_skew,feature_skew', '--algorithms=fedavg', '--aggregators=mean,gma', '--model=logistic',
       '--num_clients=4', f'--output_dir={out}'],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((out / 'results.json').read_text())
  assert len(results) == 2 * 2 * 2  # partitions x aggregators x seeds
  assert all('final_ood_accuracy' in r for r in results if r['partition'] == 'feature_skew')
  table = (out / 'results.md').read_text()
  assert '| fedavg | gma |' in table and 'feature_skew (OOD test)' in table and '(n=2)' in table
  assert (out / 'results.png').stat().st_size > 1000
