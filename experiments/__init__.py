"""Experiment scripts: benchmarks and trainers run with `python -m experiments.<name>`."""
