"""The run's plot (`accuracy.png`): accuracy and loss, of the round's clients and the test split, on integer rounds."""

import math

from training.runner import experiment


def _rows(rounds=7, eval_every=3):
  """metrics.csv rows as `experiment._read_rows` returns them: training metrics every round, test ones sometimes."""
  rows = []
  for r in range(1, rounds + 1):
    row = {'round': float(r), 'client_work/train/accuracy': 0.1 * r, 'client_work/train/loss': 2.0 / r}
    if r % eval_every == 0 or r == rounds:
      row.update({'test/accuracy': 0.09 * r, 'test/loss': 2.2 / r})
    rows.append(row)
  return rows


def test_plot_shows_accuracy_and_loss_for_train_and_test_on_integer_rounds():
  rows = _rows()
  fig = experiment._plot_figure(rows, 'digits/iid: fedavg + gma')
  accuracy, loss = fig.axes
  assert (accuracy.get_ylabel(), loss.get_ylabel()) == ('accuracy', 'loss')
  for ax, metric in ((accuracy, 'accuracy'), (loss, 'loss')):
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"train (round's clients)", 'test'}
    train, test = lines["train (round's clients)"], lines['test']
    assert list(train.get_xdata()) == [1, 2, 3, 4, 5, 6, 7]  # Every round, not only the evaluated ones.
    assert list(test.get_xdata()) == [3, 6, 7]
    assert list(test.get_ydata()) == [r[f'test/{metric}'] for r in rows if f'test/{metric}' in r]
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 7]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks  # No 2.5-round ticks.
  assert fig._suptitle.get_text() == 'digits/iid: fedavg + gma'


def test_plot_of_two_rounds_has_integer_ticks_and_skips_absent_or_non_finite_values():
  rows = [{'round': 1.0, 'client_work/train/loss': math.nan, 'validation/accuracy': 0.5, 'validation/loss': 1.5},
          {'round': 2.0, 'client_work/train/loss': 1.0, 'validation/accuracy': 0.6, 'validation/loss': 1.2}]
  accuracy, loss = experiment._plot_figure(rows, 't').axes
  assert [line.get_label() for line in accuracy.get_lines()] == ['validation']
  train = next(line for line in loss.get_lines() if line.get_label().startswith('train'))
  assert list(train.get_xdata()) == [2]  # The NaN of a diverged round is left out, not drawn as a gap at 1.
  for ax in (accuracy, loss):
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_plot_writes_a_png(tmp_path):
  path = tmp_path / 'accuracy.png'
  experiment._plot(_rows(), str(path), 'title')
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
