"""What the studies share (`training.studies.shared`): intervals and verdicts, the GMA studies' rules, the
Fashion-MNIST grid's edge rule, shards; and that no study module imports another."""

import ast
import os

import numpy as np
import pytest
from scipy import stats

import tests
from training.studies.shared import fmnist_protocol
from training.studies.shared import gma_protocol
from training.studies.shared import intervals
from training.studies.shared import study_runs


def test_t_quantiles_are_scipys_to_3_places():
  for df in range(1, 40):
    exact = stats.t.ppf(0.975, df)
    assert intervals.t_quantile_975(df) == round(exact, 3)
    assert intervals.t_quantile_975(df) == pytest.approx(exact, rel=3e-4)
  # The quantiles of the studies' committed intervals (df = seeds - 1, and their Welch dfs).
  assert [intervals.t_quantile_975(df) for df in (2, 3, 4, 6, 7)] == [4.303, 3.182, 2.776, 2.447, 2.365]
  with pytest.raises(ValueError, match='df'):
    intervals.t_quantile_975(0)


def test_paired_interval_matches_scipys_t_interval():
  rng = np.random.default_rng(0)
  for n in (2, 5, 7):
    d = rng.normal(0.4, 1.0, n)
    mean, low, high = intervals.paired_interval(d)
    ref_low, ref_high = stats.t.interval(0.95, n - 1, loc=d.mean(), scale=stats.sem(d))
    assert mean == pytest.approx(d.mean())
    assert (low, high) == pytest.approx((ref_low, ref_high), abs=2e-3 * (ref_high - ref_low))
  with pytest.raises(ValueError, match='at least 2'):
    intervals.paired_interval([1.0])


def test_welch_interval_matches_scipys():
  a, b = [1.0, 2.5, 0.3, 1.8, 2.2], [0.1, -0.4, 0.9, 0.2, -1.1]
  mean, low, high = intervals.welch_interval(a, b)
  va, vb = np.var(a, ddof=1) / 5, np.var(b, ddof=1) / 5
  df = (va + vb) ** 2 / (va ** 2 / 4 + vb ** 2 / 4)
  exact = stats.t.interval(0.95, df, loc=np.mean(a) - np.mean(b), scale=np.sqrt(va + vb))
  assert mean == pytest.approx(np.mean(a) - np.mean(b))
  # df rounded down: at least as wide as scipy's interval at the fractional df, and no wider than at floor(df).
  assert low <= exact[0] and high >= exact[1]
  floor = stats.t.interval(0.95, int(df), loc=mean, scale=np.sqrt(va + vb))
  assert (low, high) == pytest.approx(floor, rel=1e-3)


def test_verdict_reads_the_interval():
  assert intervals.verdict(0.1, 0.9) == 'GMA ahead'
  assert intervals.verdict(-0.9, -0.1) == 'AVG ahead'
  assert intervals.verdict(-0.1, 0.9) == 'undecided'
  assert intervals.verdict(0.0, 0.5) == 'undecided'  # An interval touching 0 contains it.


def test_change_is_paired_by_seed_or_welchs_between_unpaired_runs():
  new, old = [0.81, 0.83, 0.80, 0.84], [0.80, 0.80, 0.79, 0.81]
  paired = intervals.change(new, old, paired=True)
  d = 100 * (np.array(new) - np.array(old))
  assert paired['differences'] == pytest.approx(d) and paired['mean'] == pytest.approx(d.mean())
  low, high = stats.t.interval(0.95, 3, loc=d.mean(), scale=stats.sem(d))
  assert (paired['low'], paired['high']) == pytest.approx((low, high), abs=2e-3 * (high - low))  # t to 3 places.
  unpaired = intervals.change(new, old[:3], paired=False)
  assert unpaired['differences'] is None and not unpaired['paired']
  assert unpaired['old'] == pytest.approx(100 * np.mean(old[:3])) and unpaired['new'] == pytest.approx(82.0)
  assert (unpaired['mean'], unpaired['low'], unpaired['high']) == pytest.approx(
      intervals.welch_interval(100 * np.array(new), 100 * np.array(old[:3])))


def test_convergence_rule():
  assert gma_protocol.late_rise([0.5] * 19) is None
  assert gma_protocol.late_rise([0.80] * 10 + [0.82] * 10) == pytest.approx(2.0)
  assert gma_protocol.converged([0.85] * 10 + [0.80] * 10)  # A fall counts as converged: the rule is one-sided.
  assert not gma_protocol.converged([0.5] * 19)  # Too short to tell.
  assert gma_protocol.converged([0.90] * 10 + [0.904] * 10)  # +0.4 points: a plateau.
  assert not gma_protocol.converged([0.80] * 10 + [0.82] * 10)  # +2 points: still rising.
  assert gma_protocol.converged(list(np.linspace(0.1, 0.9, 30)) + [0.9] * 20)


def test_a_score_at_chance_is_one_within_a_point_of_a_single_class_predictor():
  # Fashion-MNIST's balanced test split: a model that predicts one class scores exactly 10%.
  assert gma_protocol.at_chance(0.10) and gma_protocol.at_chance(0.1099) and gma_protocol.at_chance(0.05)
  assert not gma_protocol.at_chance(0.1101) and not gma_protocol.at_chance(0.75)


def test_equal_learning_rate_line_compares_where_both_arms_learn_and_counts_the_rest_apart():
  # (AVG, GMA): two pairs where both learn (GMA +2 and -4 points), then only GMA, only AVG, neither.
  pairs = [(0.80, 0.82), (0.70, 0.66), (0.102, 0.45), (0.60, 0.1), (0.1028, 0.1028)]
  line = gma_protocol.equal_lr_line(pairs, 'here')
  assert line.startswith('- "Robust to the learning rate" (App. D.6 / Table 10, FedAvg on non-iid Fashion-MNIST')
  assert line.endswith('here: where both arms learn (above 11%), GMA above AVG in 1 of 2 pairs, below in 1, equal in '
                       '0; median difference -1.00 points. Only GMA learns in 1, only AVG in 1, neither in 1.')
  assert 'median' not in gma_protocol.equal_lr_line([(0.1, 0.1)], 'here')  # No pair where both learn: no median.


def test_a_run_is_named_as_its_directory_in_the_archives():
  # The archived runs are read back by these names (archives/gma_study_runs.tar.gz, gma_fmnist_runs.tar.gz).
  run = gma_protocol.Run('label10', 'fedadam', 'gma', 0.05, 0.1, 0.4, 3, False)
  assert run.name == 'label10-fedadam-gma-clr0.05-slr0.1-tau0.4-final-seed3' and run.method == 'fedadam/gma'
  assert run._replace(tuning=True, seed=0).name.endswith('-tau0.4-tune-seed0')
  assert gma_protocol.adaptive_optimizer('fedyogi') == 'tff' and gma_protocol.adaptive_optimizer('fedavg') != 'tff'


def test_beyond_steps_past_an_edge_of_the_grid_along_the_ladder():
  ladder = fmnist_protocol.SERVER_LR_LADDER
  assert fmnist_protocol.beyond(ladder, (1.0, 1.5, 2.0), 2.0) == 3.0
  assert fmnist_protocol.beyond(ladder, (1.0, 1.5, 2.0), 1.0) == 0.1
  assert fmnist_protocol.beyond(ladder, (1.0, 1.5, 2.0), 1.5) is None  # Inner value.
  assert fmnist_protocol.beyond(ladder, (0.001, 0.01), 0.001) is None  # The ladder's end.
  # The ladders hold the paper's grid (App. D.4) and one step beyond each end.
  assert set(fmnist_protocol.CLIENT_LR_LADDER[1:-1]) == {0.001, 0.01, 0.05, 0.1}
  assert set(fmnist_protocol.SERVER_LR_LADDER[1:-1]) == {0.01, 0.1, 1.0, 1.5, 2.0}


def test_the_edge_rule_extends_each_axis_whose_edge_the_winner_sits_on():
  client_lrs, server_lrs = fmnist_protocol.grid('fedavg')
  point = gma_protocol.Run('s', 'fedavg', 'mean', 0.1, 1.0, 0.4, 0, True)  # Any NamedTuple with the two rates.
  extension = fmnist_protocol.edge_extension(point, client_lrs, server_lrs)
  assert [(p.client_lr, p.server_lr) for p in extension] == [(0.2, 1.0), (0.1, 0.1)]  # Client lr first.
  assert fmnist_protocol.edge_extension(point._replace(client_lr=0.05, server_lr=1.5), client_lrs, server_lrs) == []
  adaptive = fmnist_protocol.edge_extension(point._replace(server_lr=0.01), *fmnist_protocol.grid('fedadam'))
  assert [(p.client_lr, p.server_lr) for p in adaptive] == [(0.2, 0.01), (0.1, 0.001)]


def test_shard_parsing():
  assert study_runs.parse_shard('0/1') == (0, 1) and study_runs.parse_shard('2/3') == (2, 3)
  for bad in ('1/1', '-1/2', '1', 'a/b', '0/0'):
    with pytest.raises(ValueError, match='shard'):
      study_runs.parse_shard(bad)


def test_shards_split_the_runs_by_name():
  runs = [gma_protocol.Run('label10', 'fedavg', 'mean', clr, 1.0, 0.4, seed, False)
          for clr in (0.01, 0.05, 0.1) for seed in range(10)]
  shards = [[r for r in runs if study_runs.in_shard(r, i, 3)] for i in range(3)]
  assert sorted(r.name for s in shards for r in s) == sorted(r.name for r in runs)  # Each run in one shard.
  assert all(shards)


def test_a_runs_shard_does_not_follow_from_its_siblings():
  # Two shards over a claims-sized grid: each about half, and a point's two tuning seeds split about as often as a
  # fair coin says (a CRC's parity puts every pair on the same side or every pair apart).
  points = [(s, a, m, clr, slr) for s in ('cfm100_mixed', 'rerun_label500') for a in ('fedavg', 'fedprox', 'fedadam')
            for m in ('mean', 'gma') for clr in (0.01, 0.05, 0.1) for slr in (0.1, 1.0, 1.5)]
  pairs = [[gma_protocol.Run(*p, 0.4, seed, True) for seed in (0, 1)] for p in points]
  first = np.array([[study_runs.in_shard(r, 0, 2) for r in pair] for pair in pairs])
  n = first.size
  assert stats.binomtest(int(first.sum()), n).pvalue > 1e-3  # Shard 0 holds about half of the runs.
  split = int((first[:, 0] != first[:, 1]).sum())
  assert stats.binomtest(split, len(pairs)).pvalue > 1e-3  # Seeds split as often as independent halves would.


class _Staged:
  """A study whose first setting's run becomes known only once another (a later setting's final) has finished."""

  def __init__(self):
    self.finished = {}

  def _run(self, name, tuning):
    return gma_protocol.Run(name, 'fedavg', 'mean', 0.01, 1.0, 0.4, 0, tuning)

  def runnable(self, stages):
    later = [self._run('later_a', False), self._run('later_b', False)]
    earlier = [self._run('earlier', True)] if self._run('later_a', False).name in self.finished else []
    return earlier + later, 0

  def config(self, run):
    return run.name

  def summary(self, run):
    return self.finished.get(run.name)


def test_a_shard_takes_the_first_runnable_run_after_every_run(monkeypatch):
  # Another shard's tuning run can make an earlier setting's runs known while this shard runs a final: the next run
  # must be the plan's first, not the next of the list computed before (which ran every later final first).
  study, order = _Staged(), []

  class Result:
    def __init__(self, name):
      order.append(name.split('-')[0])
      study.finished[name] = self.summary = {'best_accuracy': 0.5, 'best_validation_accuracy': 0.5}

  monkeypatch.setattr(study_runs.experiment, 'run', lambda config, show_progress: Result(config))
  study_runs.run_all(study, 'all', 0, 1, poll_seconds=0.01)
  assert order == ['later_a', 'earlier', 'later_b']


def _study_imports(path: str) -> set[str]:
  """The `training.studies...` modules a file imports."""
  names = set()
  for node in ast.walk(ast.parse(open(path, encoding='utf-8').read())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('training.studies'):
      names |= {f'{node.module}.{a.name}' for a in node.names}
    elif isinstance(node, ast.Import):
      names |= {a.name for a in node.names if a.name.startswith('training.studies')}
  return names


def test_no_study_imports_another_only_the_shared_modules():
  directory = os.path.join(tests.ROOT, 'training', 'studies')
  studies = [f for f in os.listdir(directory) if f.endswith('.py') and f != '__init__.py']
  assert {'gma.py', 'gma_fmnist.py', 'gma_fmnist_claims.py', 'rfa.py'} <= set(studies)
  for name in studies:
    for imported in _study_imports(os.path.join(directory, name)):
      assert imported.startswith('training.studies.shared.'), f'{name} imports {imported}'
  shared = os.path.join(directory, 'shared')
  for name in os.listdir(shared):
    if name.endswith('.py'):
      for imported in _study_imports(os.path.join(shared, name)):
        assert imported.startswith('training.studies.shared.'), f'shared/{name} imports {imported}'
