"""`python -m training.bench`: see `training.bench.cli`."""

from absl import app

from training.bench import cli

if __name__ == "__main__":
  cli.define_flags()
  app.run(cli.main)
