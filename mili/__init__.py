"""MILI: Qwen3 serving over gRPC with disaggregated prefill and decode."""

# The one place the version is written: pyproject.toml reads it, `mili --version` prints it,
# the frontend reports it (gRPC Info, HTTP GET /version).
__version__ = "0.1.0"
