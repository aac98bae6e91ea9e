"""Why RFA holds or breaks under the omniscient attack: the honest updates' spread against their mean, per round.

    python -m training.studies.rfa_spread --local_epochs=1 --trajectory=rfa|honest --output=outputs/rfa_spread/e1_rfa

Replays the RFA-limit run (digits CNN, 20 of 20 clients, 40% omniscient) as the runner trains it; writes per round
where Weiszfeld's passes and the geometric median land. Columns: docs/research/results.md#what-rfa_spread-measures"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import csv  # pylint: disable=g-import-not-at-top
import json
import math
import time

import numpy as np

from absl import app
from absl import flags

from training import command_line
from training import config as config_lib
from training.engine import corruption as corruption_lib
from training.engine import fedavg_family
from training.runner import experiment
from training.runner import round_loop

_LOCAL_EPOCHS = flags.DEFINE_integer('local_epochs', 1, 'Client epochs per round.')
_TRAJECTORY = flags.DEFINE_enum('trajectory', 'rfa', ['rfa', 'honest'], 'RFA under the omniscient attack, or the '
                                'uncorrupted mean run.')
_ROUNDS = flags.DEFINE_integer('rounds', 30, 'Rounds.')
_SEED = flags.DEFINE_integer('seed', 1, 'Seed (partition, initial model, data order, corrupted clients).')
_EXTRA_RHOS = flags.DEFINE_list('extra_rhos', ['0.1', '0.25'],
                                'Also measure, on the same updates, an attack by round(rho * 20) clients (the '
                                'seed\'s corrupted_clients for that rho): columns rho<rho>_*.')
_OUTPUT = flags.DEFINE_string('output', 'outputs/rfa_spread/measure', 'Path prefix: writes <output>.csv and '
                              '<output>.json.')

NU = 1e-6  # The library's default smoothing (geometric_median.DEFAULT_SMOOTHING; the runner's --smoothing).
RHO = 0.4


def flat(arrays) -> np.ndarray:
  return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


def weiszfeld(points: np.ndarray, weights: np.ndarray, start: np.ndarray, passes: int, nu: float = NU,
              tol: float = 0.0) -> tuple[list[np.ndarray], int]:
  """Smoothed Weiszfeld: v_{k+1} = sum b_i w_i / sum b_i, b_i = a_i / max(nu, ||v_k - w_i||). Iterates v_1..v_K.

  With tol > 0 stops once ||v_{k+1} - v_k|| <= tol (returns only the last iterate then)."""
  v = start
  out = []
  for k in range(passes):
    d = np.linalg.norm(points - v, axis=1)
    b = weights / np.maximum(nu, d)
    nxt = b @ points / b.sum()
    step = np.linalg.norm(nxt - v)
    v = nxt
    if tol > 0:
      if step <= tol:
        return [v], k + 1
    else:
      out.append(v)
  return (out if tol <= 0 else [v]), passes


def objective(points, weights, v) -> float:
  return float(weights @ np.linalg.norm(points - v, axis=1) / weights.sum())


def cos(a, b) -> float:
  na, nb = np.linalg.norm(a), np.linalg.norm(b)
  return float(a @ b / (na * nb)) if na > 0 and nb > 0 else float('nan')


def measure(updates: np.ndarray, weights: np.ndarray, corrupted: np.ndarray, rho: float = RHO):
  """(row, NumPy pass-3 estimate, m_all) for one round (updates: the 20 clients' honest updates, [20, d])."""
  honest = ~corrupted
  uh, ah = updates[honest], weights[honest]
  m = ah @ uh / ah.sum()
  nm = float(np.linalg.norm(m))
  attack = corruption_lib.omniscient_attack([[u] for u in updates], weights, corrupted)
  z = flat(attack.attack).astype(np.float32).astype(np.float64)  # As sent: the harness casts it to float32.
  m_all = flat(attack.honest_mean)
  sent = np.where(corrupted[:, None], z[None, :], updates)
  dist = np.linalg.norm(uh - m, axis=1)
  row = {
      'mean_norm': nm,
      'mean_all_norm': float(np.linalg.norm(m_all)),
      'honest_norm_mean': float(np.mean(np.linalg.norm(uh, axis=1))),
      'spread_mean': float(np.mean(dist)),
      'spread_max': float(np.max(dist)),
      'spread_ratio': float(np.mean(dist)) / nm,
      'spread_max_ratio': float(np.max(dist)) / nm,
      'honest_cos_mean': float(np.mean([cos(u, m) for u in uh])),
      'attack_norm_ratio': float(np.linalg.norm(z)) / nm,
      'attack_cos': cos(z, m),
  }
  c_rho = (1 - rho) / math.sqrt(1 - 2 * rho)
  row['guarantee_radius_ratio'] = c_rho * row['spread_max_ratio']
  # Model of the measured regime: honest points m + e_i with ||e_i|| = s, e_i mutually orthogonal (high
  # dimension), attack far along -m. Then the GM is t m/||m|| with t = ||m|| - s rho / sqrt(1 - 2 rho): the
  # honest unit pulls balance the attackers' when (1 - rho) cos = rho. Predicted signed GM length / ||m||:
  row['gm_pred_along'] = 1 - rho / math.sqrt(1 - 2 * rho) * row['spread_ratio']
  # Exact optimality at z: the honest points' unit pulls against the corrupted weight.
  pulls = (uh - z) / np.linalg.norm(uh - z, axis=1)[:, None]
  row['z_opt'] = float(np.linalg.norm(ah @ pulls) / weights[corrupted].sum())
  # RFA as run: 3 passes from zero (pass 1 = one-step RFA); also 3 passes from the mean (the paper's start).
  iterates, _ = weiszfeld(sent, weights, np.zeros_like(m), 3)
  for k, v in enumerate(iterates, 1):
    row[f'pass{k}_cos'] = cos(v, m)
    row[f'pass{k}_ratio'] = float(np.linalg.norm(v)) / nm
  mean_sent = weights @ sent / weights.sum()
  row['meanstart3_cos'] = cos(weiszfeld(sent, weights, mean_sent, 2)[0][-1], m)
  # The converged (smoothed) geometric medians.
  gm, iters = weiszfeld(sent, weights, np.zeros_like(m), 20000, tol=1e-9 * nm)
  gm = gm[0]
  gmh, _ = weiszfeld(uh, ah, np.zeros_like(m), 20000, tol=1e-9 * nm)
  gmh = gmh[0]
  row.update({
      'gm_cos': cos(gm, m), 'gm_ratio': float(np.linalg.norm(gm)) / nm, 'gm_along': float(gm @ m) / nm**2,
      'gm_dist_to_z': float(np.linalg.norm(gm - z) / np.linalg.norm(z)),
      'gm_dist_to_m_over_spread_max': float(np.linalg.norm(gm - m)) / float(np.max(dist)),
      'gm_iters': iters,
      'gm_objective_gap': objective(sent, weights, iterates[-1]) / objective(sent, weights, gm) - 1,
      'gm_honest_cos': cos(gmh, m), 'gm_honest_ratio': float(np.linalg.norm(gmh)) / nm,
  })
  return row, iterates[-1], m_all


def build_config(trajectory: str) -> config_lib.ExperimentConfig:
  common = dict(dataset='digits', model='cnn', partition='iid', num_clients=20, clients_per_round=20,
                local_epochs=_LOCAL_EPOCHS.value, rounds=_ROUNDS.value, seed=_SEED.value, algorithm='fedavg',
                eval_every=1, output_dir='/tmp/unused')
  if trajectory == 'rfa':
    return config_lib.ExperimentConfig(aggregator='rfa', num_passes=3, rfa_init='zero', smoothing=NU,
                                      corruption='omniscient', corrupt_fraction=RHO, **common)
  return config_lib.ExperimentConfig(aggregator='mean', corruption='none', **common)


class Measurements:
  """The round loop's callbacks: before a round, the model (and for the honest run the clients' updates); after it,
  the round's row, from the updates the round computed (the attacker's view for the rfa run)."""

  def __init__(self, setup: experiment.Setup, config: config_lib.ExperimentConfig, trajectory: str, seed: int):
    self.setup, self.process, self.trajectory, self.seed = setup, setup.process, trajectory, seed
    self.client_ids = list(setup.data.train.client_ids)
    self.corrupted_ids = set(corruption_lib.corrupted_clients(self.client_ids, RHO, seed))
    self.captured = {}
    self.rows = []
    if trajectory == 'rfa':
      inner = self.process.honest_client_results

      def keep(model_weights, data):  # The attacker's view of the round, kept for the measurements.
        self.captured['results'] = inner(model_weights, data)
        return self.captured['results']

      self.process.honest_client_results = keep
      assert self.corrupted_ids == set(setup.corrupted), (self.corrupted_ids, setup.corrupted)
    else:
      self.client_results = fedavg_family.build_client_results(
          fedavg_family.build_client_work(setup.model_fn, config.algorithm_config()))

  def before_round(self, round_num, state, participants, datasets):
    del round_num, participants
    self.captured['before'] = flat(self.process.get_model_weights(state).trainable)
    if self.trajectory == 'honest':
      self.captured['results'] = self.client_results(self.process.get_model_weights(state), list(datasets))
    return {}

  def after_round(self, done: round_loop.Round) -> None:
    row = self.round_row(done)
    self.rows.append(row)
    print(f"round {row['round']:2d} acc {row['test_accuracy']:.3f} |m| {row['mean_norm']:.3g} "
          f"spread/|m| {row['spread_ratio']:.2f} cos_h {row['honest_cos_mean']:.2f} "
          f"pass1/2/3 cos {row['pass1_cos']:+.2f}/{row['pass2_cos']:+.2f}/{row['pass3_cos']:+.2f} "
          f"|v3|/|m| {row['pass3_ratio']:.2f} GM cos {row['gm_cos']:+.2f} along {row['gm_along']:+.2f} "
          f"(pred {row['gm_pred_along']:+.2f}) |GM-z|/|z| {row['gm_dist_to_z']:.2g} z_opt {row['z_opt']:.2f} "
          f"check {row['check_rel_diff']:.1e}", flush=True)

  def round_row(self, done: round_loop.Round) -> dict[str, float]:
    """The round's measurements (`measure`, also at --extra_rhos), the check of the applied aggregate, accuracy."""
    after = flat(self.process.get_model_weights(done.state).trainable)
    results = self.captured.pop('results')
    updates = np.stack([flat(r.update) for r in results])
    weights = np.array([float(r.update_weight) for r in results])
    corrupted = np.array([c in self.corrupted_ids for c in done.participants])
    row, pass3, m_all = measure(updates, weights, corrupted)
    for extra in [float(x) for x in _EXTRA_RHOS.value if x]:
      ids = set(corruption_lib.corrupted_clients(self.client_ids, extra, self.seed))
      other, _, _ = measure(updates, weights, np.array([c in ids for c in done.participants]), extra)
      row.update({f'rho{extra:g}_{k}': v for k, v in other.items()})
    applied = self.captured.pop('before') - after  # Server SGD with lr 1: the aggregate itself.
    expected = pass3 if self.trajectory == 'rfa' else m_all
    row['check_rel_diff'] = float(np.linalg.norm(applied - expected) / np.linalg.norm(expected))
    row['applied_cos'] = cos(applied, updates[~corrupted].T @ weights[~corrupted])
    evaluation = self.setup.evaluator(self.process.get_model_weights(done.state))
    return {'round': done.number, 'test_accuracy': evaluation['accuracy'], 'test_loss': evaluation['loss'], **row}


def train(setup: experiment.Setup, config: config_lib.ExperimentConfig, measurements: Measurements) -> None:
  """The trajectory's rounds, as the runner trains them, with the measurements' callbacks."""
  state = round_loop.seeded_initial_state(setup.process, setup.build_keras, config.seed)
  inputs = round_loop.ClientInputs(setup.data.train, config.clients_per_round, config.local_epochs,
                                   config.batch_size, config.seed)
  placement = experiment.place_datasets(setup.method, inputs)  # Where the clients build them (the honest run).
  try:
    round_loop.RoundLoop(setup.method, state, inputs, before_round=measurements.before_round,
                         after_round=(measurements.after_round,)).run(config.rounds)
  finally:
    if placement is not None:
      placement.close()


def write_outputs(output: str, measurements: Measurements, config: config_lib.ExperimentConfig,
                  seconds: float) -> None:
  """<output>.csv (a row per round) and <output>.json (the rows, the settings, the seconds)."""
  rows = measurements.rows
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  with open(output + '.csv', 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  settings = {'local_epochs': config.local_epochs, 'trajectory': measurements.trajectory, 'rounds': config.rounds,
              'seed': measurements.seed, 'extra_rhos': list(_EXTRA_RHOS.value), 'output': output}
  with open(output + '.json', 'w') as f:
    json.dump({'settings': settings, 'nu': NU, 'rho': RHO, 'corrupted_clients': sorted(measurements.corrupted_ids),
               'seconds': seconds, 'rows': rows}, f, indent=1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  started = time.monotonic()
  command_line.check_output_file(_OUTPUT.value, 'output')  # Before the training, not after it.
  config = build_config(_TRAJECTORY.value)
  try:
    experiment.validate(config)
  except ValueError as e:
    raise app.UsageError(f'invalid flags: {e}') from e
  command_line.start_simulation()
  setup = experiment.build_setup(config)
  measurements = Measurements(setup, config, _TRAJECTORY.value, _SEED.value)
  train(setup, config, measurements)
  seconds = time.monotonic() - started
  write_outputs(_OUTPUT.value, measurements, config, seconds)
  print(f'wrote {_OUTPUT.value}.csv/.json in {seconds:.0f} s')


if __name__ == '__main__':
  command_line.run(main)
