"""Every algorithm x aggregator the registry offers, two rounds, against the NumPy reference written from its paper.

Each case builds the method as the runner does (`training.engine.methods.build`, under the session's simulation
context: secure sums for GMA's signs and the client counts), starts it from the same explicit weights as the
reference, runs two rounds on the same five clients (3, 5, 8, 6 and 4 examples, fixed order, batches of 3, one
local epoch, client momentum 0.9) and compares the model after each round; SCAFFOLD's and personalized RFA's
client-held values (c_i, v_k) too, and the adaptive norm bounds of clip_mean and zeroing_mean.

Tolerance: |project - reference| <= ATOL + RTOL |reference| per parameter. The project computes in float32
(unit roundoff 6e-8), the reference in float64; a round chains up to 3 momentum steps per client, a weighted mean
(or up to 3 Weiszfeld passes, Krum's distances, an adaptive server step) and the server update, on parameters of
order 1, so float32 rounding accounts for errors of some 1e-7 (the largest seen over every case: 1.5e-7, FedAdam
with multi-Krum, round 2). 1e-6 leaves room for other kernels' summation orders; what the suite must catch is
larger by orders of magnitude (`sensitivity_test.py`: each wrong rule it checks moves the model by more than 100 x
ATOL). The cases run the float means as plain means (the registry's default, `secure=False`), except the two of
`test_secure_means_match_within_their_error_bound`, which run them through secure sums and add their documented
error bound (`secure_mean.error_bound`) to the tolerance.
"""

import numpy as np
import pytest

from tests.methods_reference import harness
from tests import tiers
from tests.methods_reference import numpy_reference as ref
from tff_gma.aggregators import secure_mean
from training import config as config_lib
from training.engine import registry

ATOL = 1e-6
RTOL = 1e-6

_FEDAVG_AGGREGATORS = ('mean', 'gma', 'gma_binary', 'gma_dropin', 'rfa', 'rfa_one_step', 'median', 'trimmed_mean',
                       'krum', 'clip_mean', 'zeroing_mean', 'centered_clip')
# RFA's other starts and pass counts (the default, zero start with 3 passes, is in every algorithm's row), under an
# SGD server and an adaptive one.
_RFA_VARIANTS = tuple((init, passes) for init in ('zero', 'mean') for passes in (1, 2, 3)
                      if (init, passes) != ('zero', 3))

CASES = (
    [harness.Case(algorithm, aggregator)
     for algorithm in ('fedavg', 'fedprox', 'fedadam', 'fedyogi') for aggregator in _FEDAVG_AGGREGATORS]
    + [harness.Case(algorithm, 'rfa', num_passes=passes, rfa_init=init)
       for algorithm in ('fedavg', 'fedadam') for init, passes in _RFA_VARIANTS]
    # TFF's bias-corrected optimizers, the documented alternative to Reddi's Algorithm 2 (`adaptive_optimizer=tff`).
    + [harness.Case(algorithm, aggregator, adaptive_optimizer='tff')
       for algorithm in ('fedadam', 'fedyogi') for aggregator in ('mean', 'gma')]
    + [harness.Case(algorithm, 'elastic') for algorithm in ('fedavg', 'fedadam', 'fedyogi')]
    + [harness.Case('fedgma', 'mean')]
    + [harness.Case('scaffold', aggregator) for aggregator in ('mean', 'gma', 'rfa')]
    + [harness.Case('personalized', 'rfa')]
)

# The fast tier runs the first case (in CASES' order) to show each algorithm, aggregator, adaptive optimizer and
# placement of the aggregate in an adaptive server (GMA's mask on the step, Algorithm 2, or the aggregate as the
# optimizer's input): 20 of the 66; the full suite runs every case (tests/tiers.py). RFA's starts and pass counts
# are the full suite's here; the fast tier checks them against their reference in geometric_median_test.
FAST_TIER_KEYS = (
    lambda case: case.algorithm,
    lambda case: case.aggregator,
    lambda case: case.adaptive_optimizer,
    lambda case: (case.algorithm in config_lib.ADAPTIVE_ALGORITHMS, case.aggregator in ('gma', 'gma_binary')),
)


@pytest.fixture(scope='module')
def federation():
  return harness.federation()


def _assert_close(actual, expected, what, extra=0.0):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  error = np.abs(actual - expected)
  allowed = ATOL + RTOL * np.abs(expected) + extra
  worst = int(np.argmax(error - allowed))
  assert np.all(error <= allowed), (
      f'{what}: parameter {worst} is {actual[worst]!r}, the reference {expected[worst]!r} (|error| '
      f'{error[worst]:.3g} > {allowed[worst]:.3g}); largest error {error.max():.3g}')


@pytest.mark.parametrize('case', tiers.cover_once(CASES, FAST_TIER_KEYS, ids=lambda case: case.id))
def test_two_rounds_match_the_reference(case, federation):
  clients, theta0 = federation
  project = harness.run_project(case, clients, theta0)
  expected, reference = harness.run_reference(case, clients, theta0)
  for round_num, (actual, wanted) in enumerate(zip(project.thetas, expected), start=1):
    _assert_close(actual, wanted, f'{case.id}: model after round {round_num}')
  if isinstance(reference, ref.Scaffold):
    # The control variates after round 2 (round 1's are checked through round 2's model, which they steer).
    for i, kept in project.client_state[-1].items():
      _assert_close(kept, reference.client_controls[i], f'{case.id}: client {i} control variate c_i')
  if isinstance(reference, ref.PersonalizedRFA):
    for i, kept in project.client_state[-1].items():
      _assert_close(kept, reference.personal[i], f'{case.id}: client {i} personal parameters v_k')
  if case.aggregator in ('clip_mean', 'zeroing_mean'):
    kind = 'clipping' if case.aggregator == 'clip_mean' else 'zeroing'
    for round_num, (metrics, (bound, over)) in enumerate(
        zip(project.metrics, reference.aggregator.bound.history), start=1):
      measured = metrics['aggregator']
      assert measured[f'{kind}_norm'] == pytest.approx(bound, rel=1e-6), f'{case.id}: round {round_num} bound'
      assert measured['clipped_count' if kind == 'clipping' else 'zeroed_count'] == over, (
          f'{case.id}: round {round_num}, clients over the bound')


def test_every_method_of_the_registry_has_a_reference():
  """A new aggregator or algorithm record fails here until the suite compares it with a reference: every record
  appears in a case, and every FedAvg-family algorithm with every model aggregator (the composed algorithms apply
  the same aggregators, checked under FedAvg, to their own updates)."""
  covered = {(case.algorithm, case.aggregator) for case in CASES}
  assert set(registry.ALGORITHMS) == {algorithm for algorithm, _ in covered}
  assert set(registry.AGGREGATORS) == {aggregator for _, aggregator in covered}
  for algorithm in config_lib.FEDAVG_FAMILY:
    for aggregator in registry.MODEL_AGGREGATORS:
      assert (algorithm, aggregator) in covered, f'{algorithm}/{aggregator} has no reference case'


SECURE_BOUND = 4.0  # Above every coordinate of every client update here (checked), so nothing is clipped.


@pytest.mark.parametrize('aggregator', ['mean', 'gma'])
def test_secure_means_match_within_their_error_bound(aggregator, federation):
  """`--secure`: the weighted means through 32-bit secure sums. Each round is compared with the reference's round
  from the project's previous model, allowing the tolerance plus `secure_mean.error_bound` of that round's mean
  (GMA's mask multiplies it by at most 1; the server step at learning rate 1 passes it on unchanged)."""
  clients, theta0 = federation
  case = harness.Case('fedavg', aggregator, secure_bound=SECURE_BOUND)
  project = harness.run_project(case, clients, theta0)
  data = [ref.batches(x.astype(np.float64), y, harness.BATCH_SIZE) for x, y in clients]
  previous = theta0.astype(np.float64)
  for round_num, actual in enumerate(project.thetas, start=1):
    reference = harness.reference_method(case)
    expected = reference.round(previous, data)
    points, weights = reference.rounds[-1]
    assert np.max(np.abs(points)) < SECURE_BOUND
    bound = secure_mean.error_bound(len(points), weights.sum(), SECURE_BOUND, 1e4,
                                    np.abs(ref.weighted_mean(points, weights)), np.max(np.abs(points), axis=0))
    _assert_close(actual, expected, f'{case.id}: model after round {round_num}', extra=harness.SGD_SERVER_LR * bound)
    previous = actual
