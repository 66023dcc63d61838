"""The performance suite: `python -m benchmarks` (see run.py)."""
