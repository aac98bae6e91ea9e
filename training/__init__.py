"""Experiment drivers for tff-gma: the demo and the experiment runner."""
