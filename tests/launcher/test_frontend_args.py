"""`mili serve` hands the frontend flags it owns to every frontend process."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mili.errors import StartupError
from mili.serve.launcher import add_arguments
from mili.serve.plan import make_plan


def frontends_for(tmp_path: Path, *argv: str) -> list[list[str]]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--decode-port", "1", *argv])  # a fixed port: no port probing
    return make_plan(args, tmp_path).frontends


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_max_buffered_tokens_reaches_every_frontend(tmp_path: Path) -> None:
    frontends = frontends_for(tmp_path, "--frontends", "2", "--max-buffered-tokens", "16")
    assert [_value(f, "--max-buffered-tokens") for f in frontends] == ["16", "16"]
    # Unset: each frontend keeps its own default.
    assert _value(frontends_for(tmp_path)[0], "--max-buffered-tokens") is None


def test_stream_interval_reaches_every_frontend(tmp_path: Path) -> None:
    frontends = frontends_for(tmp_path, "--frontends", "3", "--stream-interval", "4")
    assert [_value(f, "--stream-interval") for f in frontends] == ["4", "4", "4"]
    assert _value(frontends_for(tmp_path)[0], "--stream-interval") is None


def test_the_admission_queue_bounds_reach_every_frontend(tmp_path: Path) -> None:
    frontends = frontends_for(
        tmp_path, "--frontends", "2", "--max-queued-requests", "0", "--max-queued-tokens", "4096"
    )
    assert [_value(f, "--max-queued-requests") for f in frontends] == ["0", "0"]
    assert [_value(f, "--max-queued-tokens") for f in frontends] == ["4096", "4096"]
    assert _value(frontends_for(tmp_path)[0], "--max-queued-requests") is None


def test_the_served_model_names_and_default_max_tokens_reach_every_frontend(
    tmp_path: Path,
) -> None:
    frontends = frontends_for(
        tmp_path,
        "--frontends",
        "2",
        "--served-model-name",
        "qwen3,Qwen/Qwen3-0.6B",
        "--default-max-tokens",
        "4096",
    )
    assert [_value(f, "--served-model-name") for f in frontends] == ["qwen3,Qwen/Qwen3-0.6B"] * 2
    assert [_value(f, "--default-max-tokens") for f in frontends] == ["4096", "4096"]
    assert _value(frontends_for(tmp_path)[0], "--served-model-name") is None


def test_an_empty_served_model_name_is_refused() -> None:
    from services.frontend.__main__ import _names
    from services.frontend.config import FrontendConfig

    assert _names("a, Qwen/Qwen3-0.6B,a") == ("a", "Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="must not be empty"):
        FrontendConfig("t:1", ("p:1",), ("d:1",), served_model_names=_names("a,,b"))


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_a_startup_timeout_that_cannot_end_well_is_refused(tmp_path: Path, timeout: str) -> None:
    """Found by a flag review: 0 or NaN ran the children and then ended in a traceback."""
    with pytest.raises(StartupError, match="--startup-timeout must be"):
        frontends_for(tmp_path, "--startup-timeout", timeout)


@pytest.mark.parametrize("timeout", ["-1", "nan", "inf"])
def test_a_drain_timeout_that_cannot_end_well_is_refused(tmp_path: Path, timeout: str) -> None:
    """Found by an exploratory test: -1 was refused by a child, after it started, as
    "drain_timeout_s must be >= 0" (its internal name)."""
    with pytest.raises(StartupError, match="--drain-timeout must be"):
        frontends_for(tmp_path, "--drain-timeout", timeout)


def test_an_unclosed_quote_in_a_childs_args_is_one_line() -> None:
    """Found by a flag review: shlex's ValueError came out as a traceback."""
    with pytest.raises(StartupError, match="--tokenizer-args: No closing quotation"):
        frontends_for(Path("unused"), "--tokenizer-args", "--max-input-chars '5")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "num_cores", "expected"),
    [
        ((), 16, 1),  # the CPU: its decode is slower than one frontend
        (("--device", "cpu"), 64, 1),
        (("--device", "cuda"), 16, 4),  # one per 4 cores
        (("--device", "cuda:1"), 8, 2),
        (("--device", "cuda"), 3, 1),  # at least one
        (("--device", "cuda"), 128, 4),  # at most MAX_DEFAULT_FRONTENDS
        (("--device", "cuda", "--frontends", "1"), 16, 1),  # as given
        (("--device", "cpu", "--frontends", "3"), 2, 3),
    ],
)
def test_frontends_default_to_one_on_the_cpu_and_one_per_4_cores_on_cuda(
    argv: tuple[str, ...], num_cores: int, expected: int
) -> None:
    from mili.serve.plan import num_frontends

    assert num_frontends(_args(*argv), num_cores) == expected


def test_the_default_frontends_share_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a 16-core machine (what the OS says this process may run on), `mili serve --device
    cuda` plans 4 frontends joined on one port, each with its own metrics port."""
    import mili.serve.plan as plan_module

    monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid: set(range(16)))
    frontends = frontends_for(tmp_path, "--device", "cuda", "--metrics-port", "9000")
    assert len(frontends) == 4
    assert all("--reuse-port" in f and _value(f, "--port") == "50051" for f in frontends)
    assert len({_value(f, "--metrics-port") for f in frontends}) == 4
    (alone,) = frontends_for(tmp_path, "--metrics-port", "9000")  # on the CPU
    assert "--reuse-port" not in alone


def test_metrics_ports_are_where_the_readme_says(tmp_path: Path) -> None:
    """README's Metrics: frontend BASE, tokenizer BASE+1, prefill i BASE+2+i, decode j
    BASE+2+P+j, frontend k >= 1 BASE+2+P+D+k-1."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--decode-port", "1", "--metrics-port", "9100", "--frontends", "3"]
    argv += ["--prefill-instances", "2", "--decode-instances", "2"]
    plan = make_plan(parser.parse_args(argv), tmp_path)

    def ports(children: list[list[str]]) -> list[str | None]:
        return [_value(argv, "--metrics-port") for argv in children]

    assert ports([plan.tokenizer]) == ["9101"]
    assert ports(plan.prefills) == ["9102", "9103"]
    assert ports(plan.decodes) == ["9104", "9105"]
    assert ports(plan.frontends) == ["9100", "9106", "9107"]
