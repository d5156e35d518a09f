"""Torch-free pipeline-split solvers (installed as fxsplit.solvers)."""
