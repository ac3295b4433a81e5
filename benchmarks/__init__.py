"""kvbench's performance suite: ``python -m benchmarks`` (see :mod:`benchmarks.__main__`)."""
