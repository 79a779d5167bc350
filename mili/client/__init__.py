"""Operator clients of a running MILI deployment: `mili generate` and `mili bench`."""

from __future__ import annotations

DEFAULT_ADDRESS = "127.0.0.1:50051"  # the frontend's default port, on this machine


def timeout_problem(timeout_s: float) -> str | None:
    """Why grpc cannot take `timeout_s` as a call's deadline, None when it can: inf (and
    anything past ~9.2e9 s) overflows its nanosecond deadline, and 0, less or NaN would end
    every call at once."""
    if 0 < timeout_s < 1e9:
        return None
    return f"--timeout must be in (0, 1e9) s, got {timeout_s}"
