"""`python -m training.bench`: see `training.bench.cli`."""

from absl import app

from training import command_line
from training.bench import cli

if __name__ == "__main__":
  cli.define_flags()
  app.run(command_line.one_line_usage_errors(cli.main))
