"""Tests for the audit failing closed: places it cannot see through give the verdict UNDECIDED (never a PASS), and
every public computation of a process is audited, not only `initialize` and `next`."""

import json

from google.protobuf import any_pb2
import numpy as np
import pytest
import tensorflow_federated as tff

from tests.tff_gma.audit import targets
from tff_gma import audit
from tff_gma.audit import policy as audit_policy
from tff_gma.audit import report as audit_report

_CLIENT_FLOAT = tff.FederatedType(np.float32, tff.CLIENTS)
_SERVER_FLOAT = tff.FederatedType(np.float32, tff.SERVER)
_SUM_TYPE = tff.FunctionType(_CLIENT_FLOAT, _SERVER_FLOAT)
_GATHER_TYPE = tff.FunctionType(_CLIENT_FLOAT, _CLIENT_FLOAT)


def _places(report):
  return [(u.computation, u.where) for u in report.undecided]


def _only_place(report):
  assert not report.ok, report.to_markdown()  # Fails closed: never a PASS.
  assert (report.verdict, report.violations) == ('UNDECIDED', []), report.to_markdown()
  (place,) = report.undecided
  return place


# --- Functional parameters and results. --------------------------------------------------------------------------


def test_calling_a_functional_parameter_from_clients_to_server_cannot_be_decided():
  # The audit cannot see what `f` does; before, this was a PASS saying that no client data reaches the server.
  report = audit.audit_computation(targets.calls_a_functional_parameter)
  place = _only_place(report)
  assert (place.computation, place.where) == ('computation', 'computation > calls_a_functional_parameter[0]')
  assert 'functional parameter' in place.reason
  assert '`({float32[3]}@CLIENTS -> float32[3]@SERVER)`' in place.reason
  assert report.flows == []
  markdown = report.to_markdown()
  assert '**Verdict: UNDECIDED (cannot be decided: 1 place the audit cannot see through).**' in markdown
  assert 'No client data reaches the server.' not in markdown
  assert '### Cannot be decided' in markdown
  assert f'- in `computation` at `computation > calls_a_functional_parameter[0]`: {place.reason}.' in markdown
  decoded = json.loads(report.to_json())
  assert (decoded['verdict'], decoded['ok']) == ('UNDECIDED', False)
  assert decoded['undecided'] == [place.to_dict()]
  assert decoded['computations'][0]['undecided'] == [place.to_dict()]


@pytest.mark.parametrize('target, where, words', [
    # A function that stays at the clients by its type may still sum at the server and broadcast back.
    ('calls_a_clients_to_clients_parameter', 'computation > calls_a_clients_to_clients_parameter[0]',
     'functional parameter'),
    # Passed to another computation: named where it is called.
    ('passes_a_functional_parameter_on', 'computation > passes_a_functional_parameter_on[0] > _apply[0]',
     'functional parameter'),
    # Returned: the caller calls it, out of sight.
    ('returns_its_functional_parameter', 'computation', 'the result holds a function'),
])
def test_a_function_the_audit_cannot_follow_cannot_be_decided(target, where, words):
  place = _only_place(audit.audit_computation(getattr(targets, target)))
  assert place.where == where
  assert words in place.reason


def test_a_function_over_unplaced_values_is_no_undecided_place():
  # Mapped at the clients, it cannot reach the server: failing closed does not make every parameter undecided.
  report = audit.audit_computation(targets.maps_an_unplaced_functional_parameter)
  assert (report.verdict, report.ok, report.undecided) == ('PASS', True, [])


def test_a_violation_with_an_undecided_place_is_a_fail_listing_both():
  report = audit.audit_computation(targets.plain_sum_and_a_functional_parameter)
  assert (report.verdict, report.ok) == ('FAIL', False)
  assert [v.intrinsic for v in report.violations] == ['federated_sum']
  assert _places(report) == [('computation', 'computation > plain_sum_and_a_functional_parameter[1]')]
  markdown = report.to_markdown()
  assert '**Verdict: FAIL (1 violation; besides, 1 place the audit cannot see through).**' in markdown
  assert '### Violations' in markdown and '### Cannot be decided' in markdown
  assert json.loads(report.to_json())['verdict'] == 'FAIL'


# --- Intrinsics and calls the walk cannot resolve, on hand-built building blocks. --------------------------------


def _argument():
  return tff.framework.Reference('arg', _CLIENT_FLOAT)


def _computation_with_local(name, local):
  """`(arg -> let name=local in name)`: the place is named by the local, as a flow's is."""
  return tff.framework.Lambda('arg', _CLIENT_FLOAT, tff.framework.Block(
      [(name, local)], tff.framework.Reference(name, local.type_signature)))


def _unknown_intrinsic_call():
  return tff.framework.Call(tff.framework.Intrinsic('custom_gather', _GATHER_TYPE), _argument())


def _call_of_a_selected_data_value():
  # A `Data` block holding a struct of one function: the walk has no function to call, only data.
  holder = tff.framework.Data(any_pb2.Any(), tff.StructType([('f', _SUM_TYPE)]))
  return tff.framework.Call(tff.framework.Selection(holder, index=0), _argument())


def _call_of_an_unbound_name():
  return tff.framework.Call(tff.framework.Reference('g', _SUM_TYPE), _argument())


def _call_of_a_data_block():
  return tff.framework.Call(tff.framework.Data(any_pb2.Any(), _SUM_TYPE), _argument())


@pytest.mark.parametrize('make_call, words', [
    (_unknown_intrinsic_call, 'the intrinsic `custom_gather` of type `({float32}@CLIENTS -> {float32}@CLIENTS)`, '
     'which the audit does not know'),
    (_call_of_a_selected_data_value, 'calls a value the walk cannot resolve to a function'),
    (_call_of_an_unbound_name, 'calls the unbound name `g`'),
    (_call_of_a_data_block, 'calls a `Data` block of type `({float32}@CLIENTS -> float32@SERVER)`'),
], ids=['unknown_intrinsic', 'data_value_called', 'unbound_name', 'data_block'])
def test_what_the_walk_cannot_resolve_cannot_be_decided_and_is_named(make_call, words):
  place = _only_place(audit.audit_computation(_computation_with_local('here', make_call())))
  assert (place.computation, place.where) == ('computation', 'computation > here')
  assert words in place.reason, place.reason


def test_an_unknown_intrinsic_over_unplaced_values_is_no_undecided_place():
  unplaced = tff.TensorType(np.float32)
  comp = tff.framework.Lambda('x', unplaced, tff.framework.Call(
      tff.framework.Intrinsic('custom_op', tff.FunctionType(unplaced, unplaced)),
      tff.framework.Reference('x', unplaced)))
  assert audit.audit_computation(comp).verdict == 'PASS'


def test_an_unknown_intrinsic_from_clients_to_server_is_a_flow_the_policy_decides():
  # Its type says that it moves client data to the server: a flow like any other, allowed only by name.
  comp = tff.framework.Lambda('arg', _CLIENT_FLOAT, tff.framework.Call(
      tff.framework.Intrinsic('custom_sum', _SUM_TYPE), _argument()))
  report = audit.audit_computation(comp)
  assert (report.verdict, [v.intrinsic for v in report.violations], report.undecided) == ('FAIL', ['custom_sum'], [])
  allowed = audit.AuditPolicy(allowed_intrinsics=audit_policy.DEFAULT_ALLOWED_INTRINSICS | {'custom_sum'})
  assert audit.audit_computation(comp, policy=allowed).verdict == 'PASS'


def test_a_bare_intrinsic_is_called_as_a_computation_is():
  # The computation is the intrinsic itself: its caller calls it on client data, a plain sum.
  report = audit.audit_computation(tff.framework.Intrinsic('federated_sum', _SUM_TYPE))
  assert not report.ok and report.verdict == 'FAIL'
  assert [(v.intrinsic, v.where, v.count) for v in report.violations] == [('federated_sum', 'computation', 1)]


# --- Every public computation of a process. ----------------------------------------------------------------------


def test_a_leak_in_next_with_client_state_fails_although_next_is_clean():
  report = audit.audit_computation(targets.leaks_only_in_next_with_client_state())
  assert [c.name for c in report.computations] == ['initialize', 'next', 'next_with_client_state']
  assert [(f.intrinsic, f.allowed) for f in report.computation('next').flows] == [('federated_mean', True)]
  assert report.verdict == 'FAIL'
  (violation,) = report.violations
  assert (violation.computation, violation.intrinsic) == ('next_with_client_state', 'federated_sum')
  assert violation.where.startswith('next_with_client_state > next_with_client_state[')
  assert 'in `next_with_client_state` at `next_with_client_state > ' in report.to_markdown()


def test_a_polymorphic_public_computation_is_refused_not_skipped():
  @tff.federated_computation
  def untyped(values):
    return tff.federated_sum(values)

  process = targets.leaks_only_in_next_with_client_state()
  process.next_with_client_state = untyped
  with pytest.raises(TypeError, match='`next_with_client_state` is a polymorphic computation'):
    audit.audit_computation(process)


_LEARNING_PROCESS_COMPUTATIONS = ['initialize', 'next', 'get_hparams', 'get_model_weights', 'next_with_client_state',
                                  'set_hparams', 'set_model_weights']


def _scaffold():
  from tff_gma import aggregators, learning  # pylint: disable=g-import-not-at-top
  model_fn = targets._model_fn()  # pylint: disable=protected-access
  return learning.build_scaffold(model_fn, tff.learning.optimizers.build_sgdm(0.1),
                                 model_aggregator=aggregators.GradientMaskedFactory())


def _personalized_rfa():
  from tff_gma import learning  # pylint: disable=g-import-not-at-top
  model_fn = targets._model_fn()  # pylint: disable=protected-access
  return learning.build_personalized_rfa(model_fn, tff.learning.optimizers.build_sgdm(0.1))


@pytest.mark.slow
@pytest.mark.parametrize('build', [_scaffold, _personalized_rfa], ids=['scaffold', 'personalized_rfa'])
def test_the_processes_with_client_state_are_audited_in_next_with_client_state(build):
  report = audit.audit_computation(build())
  assert [c.name for c in report.computations] == _LEARNING_PROCESS_COMPUTATIONS
  with_client_state = report.computation('next_with_client_state')
  # The same round as `next`: the same components, and the default metrics' plain sum in each.
  assert {f.component for f in with_client_state.flows} == {f.component for f in report.computation('next').flows}
  assert sorted((v.computation, v.intrinsic, v.component) for v in report.violations) == [
      ('next', 'federated_sum', audit_report.METRICS_AGGREGATOR),
      ('next_with_client_state', 'federated_sum', audit_report.METRICS_AGGREGATOR)]
  assert '### `next_with_client_state`' in report.to_markdown()
  for name in ('get_model_weights', 'set_model_weights', 'get_hparams', 'set_hparams'):
    assert report.computation(name).flows == ()
