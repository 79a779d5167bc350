"""Operator clients of a running MILI deployment: `mili generate` and `mili bench`."""
