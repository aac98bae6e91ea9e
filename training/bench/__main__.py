"""The benchmark: aggregator overhead and client scaling in TFF's runtime, as ratios to the mean in the same run.

    python -m training.bench [--quick | --smoke] [--sections=...] [--aggregators=mean,gma+secure,rfa+num_passes=5]

--quick: a few minutes; none: the full benchmark (a quiet machine); --smoke: every key on tiny sizes (`cli`). Writes
--output (outputs/bench/bench.json) and bench.md. Entries, sections, keys: docs/research/benchmark.md"""

from training import command_line
from training.bench import cli

if __name__ == "__main__":
  cli.define_flags()
  command_line.run(cli.main)
