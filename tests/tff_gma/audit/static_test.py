"""Tests for tff_gma.audit: flows, violations, passes and bounds read from real TFF computations."""

import json

from google.protobuf import any_pb2
import numpy as np
import pytest
import tensorflow_federated as tff

from tests.tff_gma.audit import targets
from tff_gma import audit
from tff_gma.audit import policy as audit_policy
from tff_gma.audit import report as audit_report


def _intrinsics(report):
  return sorted(f.intrinsic for f in report.flows)


def _violating(report):
  return sorted(v.intrinsic for v in report.violations)


# --- Single computations. ----------------------------------------------------------------------------------------


def test_weighted_mean_is_one_allowed_flow():
  report = audit.audit_computation(targets.weighted_mean)
  assert report.ok
  assert report.violations == []
  assert report.aggregation_passes == 1
  (flow,) = report.flows
  assert flow.intrinsic == 'federated_weighted_mean'
  assert flow.value_type == '{float32[3]}@CLIENTS'
  assert not flow.secure
  assert flow.parameters == {}
  assert (flow.count, flow.aggregation_pass, flow.allowed) == (1, 1, True)
  assert flow.where == 'computation > weighted_mean[0]'


@pytest.mark.parametrize('target, leaky_intrinsic', [
    ('plain_sum', 'federated_sum'),
    ('client_max', 'federated_max'),
    ('collect_values', 'federated_aggregate'),
    ('secure_select_by_client_keys', 'federated_secure_select'),
])
def test_leaky_computation_is_a_violation_naming_the_intrinsic(target, leaky_intrinsic):
  report = audit.audit_computation(getattr(targets, target))
  assert not report.ok
  (violation,) = report.violations
  assert violation.intrinsic == leaky_intrinsic
  assert violation.computation == 'computation'
  assert violation.where.startswith(f'computation > {target}[')
  assert violation.count == 1
  assert leaky_intrinsic in report.to_markdown()


def test_only_the_disallowed_aggregate_of_two_is_reported():
  report = audit.audit_computation(targets.mean_and_min)
  assert _intrinsics(report) == ['federated_mean', 'federated_min']
  assert _violating(report) == ['federated_min']


def test_select_reports_the_client_keys_as_the_moved_value():
  report = audit.audit_computation(targets.secure_select_by_client_keys)
  (flow,) = report.flows
  assert flow.value_type == '{int32[1]}@CLIENTS'
  assert flow.secure  # TFF marks it secure; the default policy still allows no select.
  assert 'keys' in report.violations[0].reason


def test_collecting_aggregate_really_hands_every_client_value_to_the_server():
  # The audit flags `collect_values`; running it shows why: the server receives each client's vector.
  rng = np.random.default_rng(0)
  client_values = [rng.normal(size=3).astype(np.float32) for _ in range(4)]
  collected = np.asarray(targets.collect_values(client_values))
  assert collected.shape == (4, 3)
  np.testing.assert_allclose(
      collected[np.lexsort(collected.T)], np.stack(client_values)[np.lexsort(np.stack(client_values).T)])


def test_returning_client_values_is_not_a_flow_but_is_noted():
  report = audit.audit_computation(targets.returns_client_values)
  assert report.ok
  assert report.flows == []
  assert report.aggregation_passes == 0
  assert len(report.notes) == 1 and 'CLIENTS-placed' in report.notes[0]


def test_slotted_mean_passes_although_the_server_reads_every_client_value():
  # The limitation every report states in its scope: a PASS is about which intrinsics carry client data, not about
  # what an allowed aggregate reveals. Each client puts its value in its own coordinate of a federated_mean ...
  report = audit.audit_computation(targets.slotted_mean)
  assert report.ok
  (flow,) = report.flows
  assert (flow.intrinsic, flow.value_type, flow.allowed) == ('federated_mean', '{float32[4]}@CLIENTS', True)
  # ... and the server recovers every client's value exactly from the mean.
  client_values = np.array([0.5, -1.25, 3.0, 2.0], np.float32)
  mean = np.asarray(targets.slotted_mean(list(client_values), [0, 1, 2, 3]))
  np.testing.assert_allclose(mean * len(client_values), client_values, rtol=1e-6)
  # The report says so: its scope names this case.
  assert f'**Scope.** {audit.AUDIT_SCOPE}' in report.to_markdown()
  assert json.loads(report.to_json())['scope'] == audit.AUDIT_SCOPE


# --- Policies. ---------------------------------------------------------------------------------------------------


def test_policy_can_allow_plain_sums_and_other_intrinsics():
  plain = audit.AuditPolicy(allow_plain_sum=True)
  assert audit.audit_computation(targets.plain_sum, policy=plain).ok
  assert _violating(audit.audit_computation(targets.client_max, policy=plain)) == ['federated_max']
  with_max = audit.AuditPolicy(allowed_intrinsics=audit_policy.DEFAULT_ALLOWED_INTRINSICS | {'federated_max'})
  assert audit.audit_computation(targets.client_max, policy=with_max).ok
  assert not audit.audit_computation(targets.plain_sum, policy=with_max).ok
  sums_only = audit.AuditPolicy(allowed_intrinsics=audit_policy.SECURE_SUM_INTRINSICS)
  assert _violating(audit.audit_computation(targets.weighted_mean, policy=sums_only)) == ['federated_weighted_mean']


def test_invalid_policy_arguments_raise():
  with pytest.raises(ValueError, match='allowed_intrinsics'):
    audit.AuditPolicy(allowed_intrinsics='federated_sum')
  with pytest.raises(ValueError, match='policy'):
    audit.audit_computation(targets.plain_sum, policy={'federated_sum'})


# --- Secure-sum parameters. --------------------------------------------------------------------------------------


@pytest.mark.parametrize('target, intrinsic, parameters', [
    ('secure_sum_bitwidth', 'federated_secure_sum_bitwidth', {'bitwidth': 8}),
    ('secure_sum_compiled_bound', 'federated_secure_sum', {'max_input': 1000}),
    ('secure_sum_dynamic_bound', 'federated_secure_sum', {'max_input': audit_report.DYNAMIC}),
    ('secure_modular_sum', 'federated_secure_modular_sum', {'modulus': 64}),
])
def test_secure_sum_parameters_are_read_from_the_building_block(target, intrinsic, parameters):
  report = audit.audit_computation(getattr(targets, target))
  assert report.ok
  (flow,) = report.flows
  assert (flow.intrinsic, flow.secure, flow.parameters) == (intrinsic, True, parameters)


# --- Aggregation passes. -----------------------------------------------------------------------------------------


def test_independent_aggregates_share_one_pass():
  report = audit.audit_computation(targets.independent_means)
  assert report.aggregation_passes == 1
  assert [f.aggregation_pass for f in report.flows] == [1, 1, 1]


def test_aggregate_of_values_reweighted_by_an_earlier_aggregate_is_a_second_pass():
  report = audit.audit_computation(targets.mean_then_reweighted_mean)
  assert report.aggregation_passes == 2
  assert [(f.intrinsic, f.aggregation_pass) for f in report.flows] == [('federated_mean', 1),
                                                                       ('federated_weighted_mean', 2)]


def test_broadcasting_the_state_part_of_a_zip_with_an_aggregate_adds_no_pass():
  # The broadcast value sits in a structure next to the first mean; only the state part reaches the clients.
  report = audit.audit_computation(targets.broadcast_of_state_next_to_aggregate)
  assert report.aggregation_passes == 1


@pytest.mark.parametrize('num_passes', [1, 2, 5])
def test_weiszfeld_with_r_passes_counts_r_passes(num_passes):
  report = audit.audit_computation(targets.weiszfeld_median(num_passes))
  assert report.aggregation_passes == num_passes
  assert [f.aggregation_pass for f in report.flows] == list(range(1, num_passes + 1))
  assert all(f.intrinsic == 'federated_weighted_mean' and f.count == 1 for f in report.flows)


def _numpy_weiszfeld(start, points, num_passes):
  estimate = start
  for _ in range(num_passes):
    betas = 1.0 / np.maximum(targets.WEISZFELD_NU, np.linalg.norm(points - estimate, axis=1))
    estimate = betas @ points / betas.sum()
  return estimate


def test_multi_pass_target_computes_weiszfeld_iterations():
  # The 3-pass target is what it claims to be: three dependent Weiszfeld steps (checked against NumPy).
  rng = np.random.default_rng(1)
  points = rng.normal(size=(5, 3)).astype(np.float32)
  start = np.zeros(3, np.float32)
  result = targets.weiszfeld_median_3(start, list(points))
  np.testing.assert_allclose(result, _numpy_weiszfeld(start, points.astype(np.float64), 3), rtol=1e-5, atol=1e-6)


# --- Counting and coverage, on hand-built building blocks. -------------------------------------------------------

_CLIENT_FLOAT = tff.FederatedType(np.float32, tff.CLIENTS)
_SUM_TYPE = tff.FunctionType(_CLIENT_FLOAT, tff.FederatedType(np.float32, tff.SERVER))


def _sum_lambda():
  return tff.framework.Lambda(
      'x', _CLIENT_FLOAT,
      tff.framework.Call(tff.framework.Intrinsic('federated_sum', _SUM_TYPE),
                           tff.framework.Reference('x', _CLIENT_FLOAT)))


def test_a_function_called_twice_runs_twice():
  f = tff.framework.Reference('f', _SUM_TYPE)
  arg = tff.framework.Reference('arg', _CLIENT_FLOAT)
  comp = tff.framework.Lambda('arg', _CLIENT_FLOAT, tff.framework.Block(
      [('f', _sum_lambda())], tff.framework.Struct([tff.framework.Call(f, arg), tff.framework.Call(f, arg)])))
  report = audit.audit_computation(comp, policy=audit.AuditPolicy(allow_plain_sum=True))
  (flow,) = report.flows  # One call site ...
  assert flow.count == 2  # ... that runs twice per call.
  assert report.aggregation_passes == 1


def test_an_aggregate_that_is_never_reached_is_still_reported():
  comp = tff.framework.Lambda('arg', _CLIENT_FLOAT, tff.framework.Block(
      [('unused', _sum_lambda())], tff.framework.Reference('arg', _CLIENT_FLOAT)))
  report = audit.audit_computation(comp)
  (flow,) = report.flows
  assert (flow.intrinsic, flow.count, flow.aggregation_pass) == ('federated_sum', 0, None)
  assert flow.where == 'computation > unused'
  assert _violating(report) == ['federated_sum']
  assert report.aggregation_passes == 0
  assert any('never reached' in n for n in report.notes)


def test_an_opaque_function_from_clients_to_server_cannot_be_decided():
  # What a `Data` block does is not in the computation: neither a violation nor a flow, a place that cannot be
  # decided (tests/tff_gma/audit/undecided_test.py has the other such places).
  opaque = tff.framework.Data(any_pb2.Any(), _SUM_TYPE)
  comp = tff.framework.Lambda(
      'arg', _CLIENT_FLOAT, tff.framework.Call(opaque, tff.framework.Reference('arg', _CLIENT_FLOAT)))
  report = audit.audit_computation(comp, policy=audit.AuditPolicy(allow_plain_sum=True))
  assert (report.verdict, report.ok, report.flows) == ('UNDECIDED', False, [])
  (place,) = report.undecided
  assert place.where == 'computation' and 'a `Data` block' in place.reason


def test_aggregating_an_empty_structure_is_not_a_flow():
  empty_at_clients = tff.FederatedType([], tff.CLIENTS)
  comp = tff.framework.Lambda(
      'arg', empty_at_clients,
      tff.framework.Call(
          tff.framework.Intrinsic(
              'federated_sum', tff.FunctionType(empty_at_clients, tff.FederatedType([], tff.SERVER))),
          tff.framework.Reference('arg', empty_at_clients)))
  assert audit.audit_computation(comp).flows == []


# --- Factories. --------------------------------------------------------------------------------------------------


def test_sum_factory_is_a_violation():
  report = audit.audit_computation(tff.aggregators.SumFactory(), value_type=targets.VALUE)
  assert report.computation('initialize').flows == ()
  assert [(v.computation, v.intrinsic) for v in report.violations] == [('next', 'federated_sum')]


def test_default_mean_factory_sums_in_the_clear():
  # TFF's MeanFactory divides two *plain* sums (SumFactory is its default inner factory).
  report = audit.audit_computation(tff.aggregators.MeanFactory(), value_type=targets.VALUE)
  assert [(f.intrinsic, f.value_type) for f in report.flows] == [('federated_sum', '{float32[3]}@CLIENTS'),
                                                                  ('federated_sum', '{float32}@CLIENTS')]
  assert _violating(report) == ['federated_sum', 'federated_sum']
  assert audit.audit_computation(tff.aggregators.MeanFactory(), value_type=targets.VALUE,
                                 policy=audit.AuditPolicy(allow_plain_sum=True)).ok


def test_secure_sum_factory_passes_and_shows_bitwidths():
  report = audit.audit_computation(targets.secure_sum_factory, value_type=targets.VALUE)
  assert report.ok
  assert report.aggregation_passes == 1
  assert {f.intrinsic for f in report.flows} == {'federated_secure_sum_bitwidth'}
  bitwidths = {f.value_type: f.parameters['bitwidth'] for f in report.flows}
  # The float values are quantized to int64 and summed with 32 bits; the clip counters need 1 bit.
  assert bitwidths == {'{int64[3]}@CLIENTS': 32, '{int32}@CLIENTS': 1}


def test_mean_factory_with_secure_inner_sums_passes():
  report = audit.audit_computation(targets.secure_mean_factory(), value_type=targets.VALUE,
                                   weight_type=tff.TensorType(np.float32))
  assert report.ok
  value_flows = [f for f in report.flows if f.value_type in ('{int64[3]}@CLIENTS', '{int64}@CLIENTS')]
  assert sorted(f.value_type for f in value_flows) == ['{int64[3]}@CLIENTS', '{int64}@CLIENTS']
  assert all(f.parameters == {'bitwidth': 32} for f in value_flows)


def test_factory_arguments_are_checked():
  with pytest.raises(ValueError, match='value_type'):
    audit.audit_computation(tff.aggregators.SumFactory())
  with pytest.raises(ValueError, match='weight_type'):
    audit.audit_computation(tff.aggregators.SumFactory(), value_type=targets.VALUE, weight_type=np.float32)
  with pytest.raises(ValueError, match='value_type'):
    audit.audit_computation(targets.plain_sum, value_type=targets.VALUE)
  with pytest.raises(TypeError, match='audit_computation takes'):
    audit.audit_computation(lambda x: x)


# --- Learning processes. -----------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def default_fed_avg_report():
  return audit.audit_computation(targets.fed_avg_default())


def test_default_learning_process_reports_plain_metric_sums(default_fed_avg_report):
  report = default_fed_avg_report
  assert not report.ok
  assert report.computation('initialize').flows == ()
  assert report.aggregation_passes == 1
  assert _violating(report) == ['federated_sum'] * 3  # Model update: value and weight sums; metrics: one sum.
  metric_flows = [f for f in report.flows if 'accuracy' in f.value_type]
  (metric_flow,) = metric_flows
  assert not metric_flow.allowed
  assert 'aggregator_computation' in metric_flow.where  # tff.learning.metrics.sum_then_finalize's local.


def test_secure_rfa_learning_process_passes_and_counts_its_passes():
  # A whole round with the project's secure RFA (R = 2 Weiszfeld passes) and securely summed metrics.
  report = audit.audit_computation(targets.rfa_secure_learning_process())
  assert report.ok, report.to_markdown()
  assert {f.intrinsic for f in report.flows} == {'federated_secure_sum', 'federated_secure_sum_bitwidth'}
  # The quantized model update (int64[64,10], int64[10]), summed with the quantized weight in one secure sum.
  model_update_sums = [f for f in report.flows if 'int64[64,10],int64[10]' in f.value_type]
  # R = 2 secure sums of the (quantized) model updates, one per Weiszfeld pass, in rounds 1 and 2: the secure
  # smoothing of pass 2 comes from the objective measured in round 1, so nothing else sits between them ...
  assert [f.aggregation_pass for f in model_update_sums] == [1, 2]
  assert all(set(tff.structure.flatten(tff.structure.from_container(f.parameters['bitwidth'], recursive=True)))
             == {32} for f in model_update_sums)
  # ... and the objectives ride along in the same rounds: R rounds per call for the model update.
  assert report.aggregation_passes == 2
  (metric_sum,) = [f for f in report.flows if f.value_type == '{<int64,int64,int64,int64>}@CLIENTS']
  assert metric_sum.aggregation_pass == 1 and 'aggregator_computation' in metric_sum.where


def test_the_report_names_the_component_of_each_stock_fed_avg_violation(default_fed_avg_report):
  # The case: stock FedAvg's three plain sums, one in TFF's metrics aggregator (which runs inside the client
  # work), two in the model aggregator (MeanFactory's value and weight sums), named in words.
  report = default_fed_avg_report
  components = sorted((v.component, v.intrinsic) for v in report.violations)
  assert components == [('metrics aggregator', 'federated_sum'), ('model aggregator', 'federated_sum'),
                        ('model aggregator', 'federated_sum')]
  (metric_violation,) = [v for v in report.violations if v.component == audit_report.METRICS_AGGREGATOR]
  assert 'aggregator_computation' in metric_violation.where
  model_flows = [f for f in report.flows if f.component == audit_report.MODEL_AGGREGATOR]
  assert sorted(f.value_type for f in model_flows) == ['{<float32[64,10],float32[10]>}@CLIENTS', '{float32}@CLIENTS']
  markdown = report.to_markdown()
  assert '**Verdict: FAIL (3 violations: 1 in the metrics aggregator, 2 in the model aggregator).**' in markdown
  assert '- `federated_sum` in the **metrics aggregator** of `next` at `next > next_fn[1]' in markdown
  assert '| `next` | metrics aggregator | `federated_sum` | no | 1 | 1 | 1 | **NO** |' in markdown
  assert '| `next` | model aggregator | `federated_sum` | no | 2 | 2 | 1 | **NO** |' in markdown
  assert '| pass | intrinsic | value type | secure | parameters | runs/call | allowed | component | where |' in markdown
  decoded = json.loads(report.to_json())
  assert sorted(v['component'] for v in decoded['violations']) == [
      'metrics aggregator', 'model aggregator', 'model aggregator']


def test_every_flow_of_a_secure_learning_process_has_its_component():
  report = audit.audit_computation(targets.rfa_secure_learning_process())
  assert report.ok
  assert {f.component for f in report.flows} == {audit_report.METRICS_AGGREGATOR, audit_report.MODEL_AGGREGATOR}
  # The metrics' secure sums are TFF's secure_sum_then_finalize; RFA's passes and counts the model aggregator.
  metric_flows = [f for f in report.flows if f.component == audit_report.METRICS_AGGREGATOR]
  assert all('aggregator_computation' in f.where for f in metric_flows)
  estimate_sums = [f for f in report.flows if 'int64[64,10],int64[10]' in f.value_type]
  assert {f.component for f in estimate_sums} == {audit_report.MODEL_AGGREGATOR}


def test_a_distributor_flow_is_named_distributor():
  report = audit.audit_computation(targets.fed_avg_counting_distributor())
  (violation,) = report.violations
  assert (violation.intrinsic, violation.component) == ('federated_sum', audit_report.DISTRIBUTOR)
  assert '(1 violation: 1 in the distributor)' in report.to_markdown()


def test_federated_evaluation_metrics_are_the_metrics_aggregator():
  # build_fed_eval keeps the metrics in the client work's state too; they are still its `eval` measurements.
  report = audit.audit_computation(targets.fed_eval_default())
  (violation,) = report.violations
  assert (violation.intrinsic, violation.component) == ('federated_sum', audit_report.METRICS_AGGREGATOR)


def test_client_work_aggregates_that_are_not_metrics_are_client_work():
  # SCAFFOLD's client work averages the control-variate deltas (its state) and counts the participants besides
  # summing the metrics: only the metrics' sum is the metrics aggregator.
  from tff_gma import aggregators, learning  # pylint: disable=g-import-not-at-top
  process = learning.build_scaffold(
      targets._model_fn(), tff.learning.optimizers.build_sgdm(0.1),  # pylint: disable=protected-access
      model_aggregator=aggregators.GradientMaskedFactory())
  for computation in (process.next, process.next_with_client_state):
    report = audit.audit_computation(computation)
    by_component = sorted((f.component, f.intrinsic) for f in report.flows
                          if f.component in (audit_report.CLIENT_WORK, audit_report.METRICS_AGGREGATOR))
    assert by_component == [('client work', 'federated_mean'), ('client work', 'federated_secure_sum'),
                            ('metrics aggregator', 'federated_sum')], report.to_markdown()
    assert {f.component for f in report.flows} == {
        audit_report.CLIENT_WORK, audit_report.METRICS_AGGREGATOR, audit_report.MODEL_AGGREGATOR}


def test_computations_that_are_not_composed_processes_have_no_components():
  for report in (audit.audit_computation(targets.plain_sum),
                 audit.audit_computation(targets.secure_gma(), value_type=_MODEL_LIKE)):
    assert {f.component for f in report.flows} == {None}
    assert 'component' not in report.to_markdown().split('### Violations')[0].split('**Scope.**')[1]


# --- The project's aggregators. ----------------------------------------------------------------------------------

_MODEL_LIKE = tff.to_type([tff.TensorType(np.float32, [3]), tff.TensorType(np.float32, [2])])


@pytest.mark.parametrize('num_passes', [1, 3])
def test_rfa_runs_one_estimate_mean_per_pass_in_sequence(num_passes):
  from tff_gma import aggregators  # pylint: disable=g-import-not-at-top
  report = audit.audit_computation(aggregators.GeometricMedianFactory(num_passes=num_passes),
                                   value_type=_MODEL_LIKE)
  assert report.ok
  estimate_means = [f for f in report.flows if f.value_type == '{<<float32[3],float32[2]>,float32>}@CLIENTS']
  assert [(f.intrinsic, f.aggregation_pass) for f in estimate_means] == [
      ('federated_mean', k) for k in range(1, num_passes + 1)]
  # The objective of the estimate broadcast by each pass is a mean in that pass's round, not a round of its own.
  objective_means = [f for f in report.flows if f.value_type == '{<float32,float32>}@CLIENTS']
  assert [f.aggregation_pass for f in objective_means] == list(range(1, num_passes + 1))
  assert report.aggregation_passes == num_passes


def test_secure_rfa_uses_only_secure_sums():
  report = audit.audit_computation(targets.secure_rfa(3), value_type=_MODEL_LIKE)
  assert report.ok
  assert {f.intrinsic for f in report.flows} <= audit_policy.SECURE_SUM_INTRINSICS
  estimate_sums = [f for f in report.flows if 'int64[3],int64[2]' in f.value_type]
  assert [f.aggregation_pass for f in estimate_sums] == [1, 2, 3]
  assert report.aggregation_passes == 3


@pytest.mark.parametrize('secure', [False, True])
def test_rfa_with_r_passes_shows_r_passes(secure):
  # The budget: RFA with R passes costs R sequential rounds; the optional final objective one more.
  from tff_gma import aggregators  # pylint: disable=g-import-not-at-top
  bounds = dict(secure=True, value_bound=1.0, weight_bound=100.0) if secure else {}
  for num_passes in (1, 2, 3):
    for final_objective in (False, True):
      factory = aggregators.GeometricMedianFactory(
          num_passes=num_passes, report_final_objective=final_objective, **bounds)
      report = audit.audit_computation(factory, value_type=_MODEL_LIKE)
      assert report.ok
      assert report.aggregation_passes == num_passes + final_objective, (num_passes, final_objective)
  one_step = audit.audit_computation(aggregators.GeometricMedianFactory(one_step=True, **bounds),
                                     value_type=_MODEL_LIKE)
  assert one_step.ok and one_step.aggregation_passes == 1


def test_secure_gma_is_one_pass_of_secure_sums():
  report = audit.audit_computation(targets.secure_gma(), value_type=_MODEL_LIKE)
  assert report.ok
  assert report.aggregation_passes == 1
  assert {f.intrinsic for f in report.flows} == {'federated_secure_sum', 'federated_secure_sum_bitwidth'}
  (sign_sum,) = [f for f in report.flows if f.value_type == '{<int32[3],int32[2]>}@CLIENTS']
  assert sign_sum.parameters == {'max_input': [2, 2]}


# --- Rendering. --------------------------------------------------------------------------------------------------


def test_to_json_round_trips(default_fed_avg_report):
  report = default_fed_avg_report
  decoded = json.loads(report.to_json())
  assert decoded['ok'] is False
  assert decoded['aggregation_passes'] == 1
  # Every public computation of the learning process, `initialize` and `next` first.
  assert [c['name'] for c in decoded['computations']] == [
      'initialize', 'next', 'get_hparams', 'get_model_weights', 'set_hparams', 'set_model_weights']
  assert (decoded['verdict'], decoded['undecided']) == ('FAIL', [])
  assert len(decoded['violations']) == 3
  flows = decoded['computations'][1]['flows']  # `next`.
  assert [f['intrinsic'] for f in flows] == [f.intrinsic for f in report.computation('next').flows]
  assert [f['where'] for f in flows] == [f.where for f in report.computation('next').flows]
  assert decoded['policy']['allow_plain_sum'] is False
  bounded = json.loads(audit.audit_computation(targets.secure_sum_factory, value_type=targets.VALUE).to_json())
  assert {f['parameters']['bitwidth'] for f in bounded['computations'][1]['flows']} == {1, 32}


def test_every_report_states_what_a_pass_establishes_and_what_it_does_not():
  scope = audit.AUDIT_SCOPE
  # What a PASS means: the allowed intrinsics and the number of sequential passes ...
  assert 'through an intrinsic the policy allows' in scope and 'sequential' in scope
  # ... and what it does not: an aggregate revealing little (the slotted federated_mean), differential privacy,
  # the client-side code, the runtime and transport.
  for caveat in ('its own coordinate of a `federated_mean`', 'differential privacy', 'client-side',
                 'runtime', 'transport'):
    assert caveat in scope, caveat
  for report in (audit.audit_computation(targets.weighted_mean), audit.audit_computation(targets.plain_sum)):
    markdown = report.to_markdown()
    assert f'\n**Scope.** {scope}\n' in markdown
    assert markdown.index('**Scope.**') < markdown.index('| computation | intrinsic |')  # Next to the verdict.
    assert report.to_dict()['scope'] == scope


def test_to_markdown_has_verdict_and_tables():
  report = audit.audit_computation(targets.mean_then_reweighted_mean)
  text = report.to_markdown()
  assert '**Verdict: PASS.**' in text
  assert 'aggregation passes per call of `computation`: **2**' in text
  assert '| pass | intrinsic | value type | secure | parameters | runs/call | allowed | where |' in text
  assert '| 2 | `federated_weighted_mean` | `{float32[3]}@CLIENTS` | no | - | 1 | yes |' in text
  assert '| computation | intrinsic | secure | call sites | runs/call | passes | allowed |' in text
  leaky = audit.audit_computation(targets.plain_sum).to_markdown()
  assert '**Verdict: FAIL (1 violation).**' in leaky
  assert '### Violations' in leaky and '**NO**' in leaky
