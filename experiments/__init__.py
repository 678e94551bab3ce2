"""Experiments: the runs that produced the figures in docs/, kept runnable but outside the product.

Run one from the repository root as `python -m experiments.NAME --help` (experiments/README.md lists them,
each with the figure it made). They import the product (stallfree); nothing under stallfree/, engine/ or
operator/ imports them (tests/test_static_checks.py), and they are not part of the installed package.
"""
