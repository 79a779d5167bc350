"""The CUDA driver's JIT logs of one PTX load, and the error text built from them (pure: no
driver here, so it is tested on CPU).

kernels/cuda_driver.py loads PTX with `cuModuleLoadDataEx` and these options, so that a PTX the
driver cannot JIT-compile fails with what ptxas said (the line, the instruction) and not only with
CUDA_ERROR_INVALID_PTX. The options, as cuda.h's CUjit_option numbers them:

    CU_JIT_INFO_LOG_BUFFER              3   char *        the info log is written here
    CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES   4   unsigned int  its size, the closing NUL included
    CU_JIT_ERROR_LOG_BUFFER             5   char *        the error log is written here
    CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES  6   unsigned int  its size, the closing NUL included

The driver also writes each log's length back into the option values, but cuda-python keeps
that array to itself: a log ends at its first NUL instead (the buffers start zeroed).
"""

from __future__ import annotations

LOG_BYTES = 16 * 1024  # per log: ptxas writes one line per error, so a few KB hold dozens


def log_text(buffer: bytes | bytearray) -> str:
    """A log buffer's text: up to its first NUL, marked when the driver had to cut it."""
    raw = bytes(buffer).split(b"\0", 1)[0]
    text = raw.decode(errors="replace").strip()
    # The driver caps a log at the buffer's size with the NUL included: a full buffer may have
    # lost its tail.
    if len(raw) >= len(buffer) - 1 and text:
        text += f"\n[log cut at {len(buffer)} bytes]"
    return text


class JitLogs:
    """The error and info log buffers of one `cuModuleLoadDataEx` call. Keep this object alive
    through the call: the driver writes into its buffers."""

    def __init__(self, num_bytes: int = LOG_BYTES) -> None:
        self.error = bytearray(num_bytes)
        self.info = bytearray(num_bytes)

    def options(self) -> list[tuple[str, bytearray | int]]:
        """(CUjit_option member name, value) pairs to hand the driver: each buffer, then its
        size. Names, not numbers: the bindings' enum is looked up by name."""
        return [
            ("CU_JIT_ERROR_LOG_BUFFER", self.error),
            ("CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES", len(self.error)),
            ("CU_JIT_INFO_LOG_BUFFER", self.info),
            ("CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES", len(self.info)),
        ]

    def describe(self) -> str:
        """What the logs hold, to append to a load's error message ("" when both are empty)."""
        parts = []
        for label, buffer in (("JIT error log", self.error), ("JIT info log", self.info)):
            text = log_text(buffer)
            if text:
                parts.append(f"{label}:\n" + "\n".join("  " + line for line in text.splitlines()))
        return "\n" + "\n".join(parts) if parts else ""
