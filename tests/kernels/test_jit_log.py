"""kernels/jit_log.py: the JIT log options a PTX load hands the driver, and the error text read
back from the buffers, with the driver's writes played by hand (the load itself is a GPU test
in test_gpu.py, which also checks the bindings number these options as cuda.h does)."""

from __future__ import annotations

from kernels.jit_log import JitLogs, log_text

PTXAS_ERROR = (
    "ptxas application ptx input, line 7; error   : Unknown symbol '%mili_undeclared'\n"
    "ptxas fatal   : Ptx assembly aborted due to errors\n"
)


def _write(buffer: bytearray, text: str) -> None:
    """What the driver does: the log, NUL-terminated, at most the buffer's size."""
    data = text.encode()[: len(buffer) - 1] + b"\0"
    buffer[: len(data)] = data


def test_each_log_buffer_is_passed_with_its_own_size() -> None:
    logs = JitLogs(num_bytes=100)
    options = logs.options()
    assert [name for name, _ in options] == [
        "CU_JIT_ERROR_LOG_BUFFER",
        "CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES",
        "CU_JIT_INFO_LOG_BUFFER",
        "CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES",
    ]
    values = dict(options)
    # The buffers themselves (the driver writes into them), zeroed, each followed by its size.
    assert values["CU_JIT_ERROR_LOG_BUFFER"] is logs.error
    assert values["CU_JIT_INFO_LOG_BUFFER"] is logs.info
    assert logs.error is not logs.info
    assert values["CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES"] == len(logs.error) == 100
    assert values["CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES"] == len(logs.info) == 100
    assert logs.error == bytearray(100) and logs.info == bytearray(100)


def test_describe_quotes_the_error_log_then_the_info_log() -> None:
    logs = JitLogs()
    _write(logs.error, PTXAS_ERROR)
    _write(logs.info, "ptxas info    : 0 bytes gmem\n")
    assert logs.describe() == (
        "\nJIT error log:\n"
        "  ptxas application ptx input, line 7; error   : Unknown symbol '%mili_undeclared'\n"
        "  ptxas fatal   : Ptx assembly aborted due to errors\n"
        "JIT info log:\n"
        "  ptxas info    : 0 bytes gmem"
    )


def test_describe_leaves_out_empty_logs() -> None:
    logs = JitLogs()
    assert logs.describe() == ""
    _write(logs.error, PTXAS_ERROR)
    assert "JIT info log" not in logs.describe()
    assert "Unknown symbol '%mili_undeclared'" in logs.describe()


def test_log_text_stops_at_the_first_nul_and_marks_a_cut_log() -> None:
    buffer = bytearray(64)
    _write(buffer, "short")
    buffer[10:20] = b"stale text"  # past the NUL: not part of the log
    assert log_text(buffer) == "short"
    full = bytearray(16)
    _write(full, "x" * 40)  # the driver keeps 15 bytes and the NUL
    assert log_text(full) == "x" * 15 + "\n[log cut at 16 bytes]"
    assert log_text(bytearray(8)) == ""


def test_log_text_survives_bytes_that_are_not_utf8() -> None:
    buffer = bytearray(32)
    buffer[:6] = b"bad \xff\0"
    assert log_text(buffer) == "bad \ufffd"
