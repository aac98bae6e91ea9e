"""`python -m training.bench`: see `training.bench.cli`."""

from training import command_line
from training.bench import cli

if __name__ == "__main__":
  cli.define_flags()
  command_line.run(cli.main)
