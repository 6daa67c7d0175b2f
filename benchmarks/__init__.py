"""gpubroker benchmarks; run with ``make bench`` (``python -m benchmarks``)."""
