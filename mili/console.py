"""The process's own stdout and stderr, which may be gone.

A reader that exited (`mili serve | head`, `mili serve-tokenizer | grep -m1 listening`, a closed
terminal) turns every later write into BrokenPipeError (or EIO). A line no one reads is dropped
here: raising from a print stopped `mili serve`'s signal handler before its shut-down began,
and made a service (or `mili serve`) exit 1 right after announcing its address.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TextIO


def to_stdout(text: str) -> None:
    """Write `text` (its newline included: one write, never a line without its end) and flush."""
    _write(sys.stdout, text)


def to_stderr(text: str) -> None:
    """As to_stdout, to stderr."""
    _write(sys.stderr, text)


def _write(stream: TextIO, text: str) -> None:
    with contextlib.suppress(OSError):  # BrokenPipeError, EIO
        stream.write(text)
        stream.flush()
