"""The runner and its outputs: the experiment, the one round loop, checkpoints, the output-directory lock."""
