"""GMA in your own TFF pipeline, end to end: a script to copy and adapt.

Your Keras model and your data (here scikit-learn's 8x8 digits, embedded, no download) as `tff.simulation`
client data; TFF's FedAvg with Gradient Masked Averaging as the model aggregator and securely summed metrics;
the privacy audit of the training and evaluation rounds (PASS); a few rounds with progress; federated evaluation
on held-out clients before and after training. The README's example is this script's lines
(`tests/examples_test.py` keeps them identical and runs the script).

Run from the checkout (about a minute on 2 CPU cores; `bash scripts/setup.sh` makes `.venv/`):

    .venv/bin/python examples/federated_digits.py

For RFA instead of GMA, replace the model aggregator by `tff_gma.aggregators.GeometricMedianFactory()`.
"""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

import tff_gma.aggregators
import tff_gma.audit
import tff_gma.data.digits
import tff_gma.runtime

NUM_CLIENTS, NUM_ROUNDS, BATCH_SIZE = 10, 5, 16


def label_skewed_clients(x, y, num_clients, seed=0):
  """Your arrays as per-client data: sorted by label and cut in 2 shards per client (mostly 2 digits each)."""
  shards = np.array_split(np.argsort(y, kind='stable'), 2 * num_clients)
  pairs = np.random.default_rng(seed).permutation(2 * num_clients).reshape(num_clients, 2)
  return {
      f'client_{i}': collections.OrderedDict(x=x[np.concatenate([shards[j] for j in pair])],
                                             y=y[np.concatenate([shards[j] for j in pair])])
      for i, pair in enumerate(pairs)
  }


def secure_metrics_process(model_fn):
  """Securely summed metrics as the process `build_fed_eval` takes (it has no `metrics_aggregator=` argument)."""
  with tf.Graph().as_default():
    model = model_fn()
    metrics_type = tff.to_type(tf.nest.map_structure(
        lambda t: tff.TensorType(t.dtype.as_numpy_dtype, t.shape), model.report_local_unfinalized_metrics()))
  # Fixed ranges [0, 2**20 - 1], as `secure_sum_then_finalize` uses: `SecureSumFactory()`'s default float bounds
  # start at 100 and adapt over rounds, clipping a client's loss sum until then (a fresh evaluation never adapts).
  ranges = tff.learning.metrics.create_default_secure_sum_quantization_ranges(
      metrics_type, use_auto_tuned_bounds_for_float_values=False)
  factory = tff.learning.metrics.SumThenFinalizeFactory(
      model.metric_finalizers(), inner_summation_factory=tff.learning.metrics.SecureSumFactory(ranges))
  return factory.create(metrics_type)


def main():
  tff_gma.runtime.set_simulation_context()  # a TFF context that runs the secure-sum intrinsics

  digits = tff_gma.data.digits.load_split()  # your arrays: x float32 [n, 8, 8, 1] in [0, 1], y int32 labels
  train_data = tff.simulation.datasets.TestClientData(
      label_skewed_clients(digits.x_train, digits.y_train, NUM_CLIENTS))
  test_data = tff.simulation.datasets.TestClientData(label_skewed_clients(digits.x_test, digits.y_test, 4))
  train_datasets = [train_data.create_tf_dataset_for_client(c).shuffle(500, seed=0).batch(BATCH_SIZE)
                    for c in train_data.client_ids]
  test_datasets = [test_data.create_tf_dataset_for_client(c).batch(64) for c in test_data.client_ids]
  input_spec = train_datasets[0].element_spec

  def model_fn():  # your Keras model, built afresh on each call
    keras_model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation='relu', kernel_initializer=tf.keras.initializers.GlorotUniform(0)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10, kernel_initializer=tf.keras.initializers.GlorotUniform(1)),
    ])
    return tff.learning.models.from_keras_model(
        keras_model, input_spec=input_spec,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy')])

  process = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn,
      client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.05, momentum=0.9),
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0),
      model_aggregator=tff_gma.aggregators.GradientMaskedFactory(tau=0.4),  # or GeometricMedianFactory()
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize,
  )
  evaluation = tff.learning.algorithms.build_fed_eval(
      model_fn, metrics_aggregation_process=secure_metrics_process(model_fn))

  for name, computation in (('training', process), ('evaluation', evaluation)):
    report = tff_gma.audit.audit_computation(computation)
    print(f'audit of the {name} round: {"PASS" if report.ok else "FAIL"}')
    assert report.ok, report.to_markdown()  # every flow of client data to the server, and its component

  def evaluate(model_weights):
    eval_state = evaluation.set_model_weights(evaluation.initialize(), model_weights)
    return evaluation.next(eval_state, test_datasets).metrics['client_work']['eval']['current_round_metrics']

  state = process.initialize()
  before = evaluate(process.get_model_weights(state))
  for round_num in range(1, NUM_ROUNDS + 1):
    result = process.next(state, train_datasets)
    state = result.state
    train, aggregator = result.metrics['client_work']['train'], result.metrics['aggregator']
    measured = (f'coordinates masked {aggregator["masked_fraction"]:.3f}' if 'masked_fraction' in aggregator
                else f'RFA objective {aggregator["objective"][-1]:.3f}')  # GMA's or RFA's measurements
    print(f'round {round_num}/{NUM_ROUNDS}: train loss {train["loss"]:.3f}, accuracy {train["accuracy"]:.3f}, '
          f'{measured}')
  after = evaluate(process.get_model_weights(state))
  print(f'evaluation on {len(test_datasets)} held-out clients: accuracy {before["accuracy"]:.3f} before training, '
        f'{after["accuracy"]:.3f} after {NUM_ROUNDS} rounds (loss {before["loss"]:.3f} -> {after["loss"]:.3f})')


if __name__ == '__main__':
  main()
