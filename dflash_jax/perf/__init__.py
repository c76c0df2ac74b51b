"""Measurement tools, kept out of the library's import path: the benchmark, rooflines and HLO byte
models, the miniature regime, scaling, step profiles, quantization and sharding reports, random-weight
models at real shapes, the kernels' compile report and bench, and the one-command GPU check.
"""
