"""The settings' checks, group by group, in the order `validate` runs them (the first that fails names its setting)."""

import dataclasses

import pytest

from training import config as config_lib
from training.runner import config_checks
from training.runner import errors

_OK = config_lib.ExperimentConfig(dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3,
                                  rounds=3, model='logistic', output_dir='/tmp/never_written_by_this_test')


def test_a_valid_config_passes_every_group():
  for check in (config_checks._check_names, config_checks._check_numbers, config_checks._check_combinations,
                config_checks._check_validation):
    check(_OK)


@pytest.mark.parametrize('check, changes, message', [
    (config_checks._check_names, {'model': 'transformer'}, "model: unknown model 'transformer'"),
    (config_checks._check_names, {'dataset_placement': 'cloud'}, "dataset_placement: unknown placement 'cloud'"),
    (config_checks._check_names, {'workers': 'localhost'}, "workers must be host:port"),
    (config_checks._check_names, {'worker_intra_op_threads': -1}, 'worker_intra_op_threads must be'),
    (config_checks._check_numbers, {'batch_size': 0}, 'batch_size'),
    (config_checks._check_numbers, {'eval_last_rounds': True}, 'eval_last_rounds must be an integer >= 0'),
    (config_checks._check_numbers, {'max_frozen_rounds': -1}, 'max_frozen_rounds must be an integer >= 0'),
    (config_checks._check_numbers, {'max_frozen_rounds': 2.5}, 'max_frozen_rounds must be an integer >= 0'),
    (config_checks._check_numbers, {'seed': config_checks.MAX_SEED + 1},
     r'seed must be an integer in \[0, 4294967295\]'),
    (config_checks._check_numbers, {'alpha': float('nan')}, 'alpha must be finite'),
    (config_checks._check_combinations, {'clients_per_round': 5}, r'clients_per_round \(5\) exceeds num_clients \(4\)'),
    (config_checks._check_combinations, {'beta': 0.0}, 'beta must be positive'),
    (config_checks._check_combinations, {'secure': True}, 'secure_bound: secure=True clips'),
    (config_checks._check_combinations, {'model': 'char_lstm'}, 'model: char_lstm needs dataset=shakespeare'),
    (config_checks._check_combinations, {'rfa_weight_bound': 0.9}, 'rfa_weight_bound: the RFA weight audit replays'),
    (config_checks._check_validation, {'validation_fraction': 1.0}, r'validation_fraction must lie in \[0, 1\)'),
    (config_checks._check_validation, {'validation_fraction': 0.2, 'membership_inference': True},
     'validation_fraction: membership_inference attacks'),
    (config_checks._check_validation, {'validation_fraction': 0.2, 'algorithm': 'personalized', 'aggregator': 'rfa'},
     'algorithm=personalized already holds out 0.2 of each client'),
])
def test_each_group_refuses_its_settings_by_name(check, changes, message):
  with pytest.raises(errors.ConfigError, match=message):
    check(dataclasses.replace(_OK, **changes))


def test_validate_runs_the_groups_in_order_and_names_the_first_refused_setting():
  # Refused by two groups: the names' group runs first.
  both = dataclasses.replace(_OK, model='transformer', batch_size=0)
  with pytest.raises(errors.ConfigError, match='model: unknown model'):
    config_checks.validate(both)
  with pytest.raises(errors.ConfigError, match='batch_size'):
    config_checks.validate(dataclasses.replace(both, model='logistic'))
  # The numbers before the combinations (clients_per_round > num_clients as well as a zero batch size).
  with pytest.raises(errors.ConfigError, match='batch_size'):
    config_checks.validate(dataclasses.replace(_OK, batch_size=0, clients_per_round=5))


def test_a_library_value_error_is_raised_as_a_config_error():
  # The partition's own check raises ValueError; validate names it as a setting error.
  with pytest.raises(errors.ConfigError, match='partition'):
    config_checks.validate(dataclasses.replace(_OK, partition='by_writer'))
