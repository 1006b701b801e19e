"""Microbenchmarks for specdec_kernels: one harness, one module per op family, results as
JSON/CSV rows and plots as PNG. ``python -m bench --help`` lists the options; docs/bench.md
explains the columns and the byte formulas.

Nothing here touches CUDA at import time: the device is queried only when a run starts.
"""
