"""A `mili serve` under measurement, for the serving benchmarks (serving.py, serve_gpu.py,
kv_growth.py, ...): started on free ports from a source tree (`mili_serve`, drained on exit)
with the threads and extra flags asked, what each child runs and the CPU each spends, a `mili
bench` run against it; the model directories it serves (a cached random Qwen3-0.6B checkpoint
beside the demo tokenizer), and the same checkpoint in this process (`load_model`; its bare
decode step, `BareDecode`, to compare the pipeline with)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from mili.client import bench as client
from mili.engine.model.checkpoint import cached_random_checkpoint
from mili.engine.model.config import PRESETS
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_model as _load_weights
from mili.engine.model.qwen3 import DecodeBatch, PrefillBatch, Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.sampler import Sampler, SequenceSampling
from mili.serve.child import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen3-0.6b"
TOKEN_ID_RANGE = "0:256"  # byte tokens: inside the demo tokenizer's vocabulary (and Qwen3's)
BLOCK_SIZE = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


# ---- models ----------------------------------------------------------------------------------


def checkpoint_dir(cache_dir: Path) -> Path:
    """The bf16 Qwen3-0.6B checkpoint (seed 0), written once (shared with the other benchmarks)."""
    return cached_random_checkpoint(PRESETS[MODEL], MODEL, cache_dir)


def demo_dir() -> Path:
    from mili.demo.model import default_model_dir

    return default_model_dir()


@contextlib.contextmanager
def servable(weights: Path) -> Iterator[Path]:
    """`weights` (config + safetensors, no tokenizer) plus the demo tokenizer, as one model dir.

    Symlinks in a temporary directory: the tokenizer service needs tokenizer.json, and any
    byte-level tokenizer does for token-id prompts (ids it does not know are left out of text).
    """
    tokenizer = demo_dir()
    with tempfile.TemporaryDirectory(prefix="mili-serving-") as tmp:
        model_dir = Path(tmp) / weights.name
        model_dir.mkdir()
        for path in weights.iterdir():
            if path.name not in TOKENIZER_FILES:
                (model_dir / path.name).symlink_to(path)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).exists():
                (model_dir / name).symlink_to(tokenizer / name)
        yield model_dir


def load_model(path: Path, *, dtype: torch.dtype, attention: str) -> Any:
    """The checkpoint with the attention backend and fused ops `mili serve --attention` runs:
    the in-process (bare, engine) runs then compare like with like."""
    from kernels.backend import select_attention, select_fused_ops

    model = _load_weights(path, dtype=dtype)
    head_dim = model.config.head_dim
    model.attention = select_attention(attention, "cpu", head_dim=head_dim)
    model.fused_ops = select_fused_ops(attention, "cpu", head_dim=head_dim)
    return model


# ---- mili serve ------------------------------------------------------------------------------


@dataclass
class Served:
    address: str
    proc: subprocess.Popen[str]
    log: TextIO
    metrics: dict[str, str] = field(default_factory=dict)  # child name -> its /metrics URL
    children: dict[str, str] = field(default_factory=dict)  # child name -> its gRPC address

    @property
    def cpu(self) -> CpuMeter:
        return CpuMeter(self.proc.pid)


def kernels_served(served: Served) -> dict[str, str]:
    """What each prefill and decode instance of `served` runs, from its Info: "attention X,
    fused ops Y, N CUDA graphs" (with --attention auto, "torch" where a Mojo kernel failed its
    start-up self-check; N: the step's captured sizes, 0 eager), or "-" with the status when it
    did not answer."""
    import grpc

    from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
    from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc

    stubs: dict[str, tuple[Any, Any]] = {  # kind -> (its stub class, its InfoRequest)
        "prefill": (prefill_pb2_grpc.PrefillServiceStub, prefill_pb2.InfoRequest()),
        "decode": (decode_pb2_grpc.DecodeServiceStub, decode_pb2.InfoRequest()),
    }
    found = {}
    for name, address in sorted(served.children.items()):
        kind = name.split("-")[0]
        if kind not in stubs:
            continue
        stub, request = stubs[kind]
        try:
            with grpc.insecure_channel(address) as channel:
                info = stub(channel).Info(request, timeout=10)
            found[name] = (
                f"attention {info.attention_backend}, fused ops {info.fused_ops}, "
                f"{info.num_cuda_graphs} CUDA graphs"
            )
        except grpc.RpcError as e:
            found[name] = f"- ({e.code().name})"
    return found


def _cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def services(launcher: int) -> dict[str, int]:
    """{"tokenizer": pid, "prefill": pid, ...}: the children of `mili serve` (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if ppid == launcher:
                kind = next(a.decode() for a in argv if a.startswith(b"serve-"))
                found[kind.removeprefix("serve-")] = int(entry.name)
    return dict(sorted(found.items()))


class CpuMeter:
    """CPU seconds each service of one `mili serve`, and this (client) process, spend."""

    def __init__(self, launcher: int) -> None:
        self.pids = services(launcher)

    def _now(self) -> dict[str, float]:
        now = {name: _cpu_s(pid) for name, pid in self.pids.items()}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return now | {"client": usage.ru_utime + usage.ru_stime}

    @contextlib.contextmanager
    def measure(self, out: dict[str, float]) -> Iterator[None]:
        before = self._now()
        yield
        after = self._now()
        for name, value in after.items():
            out[name] = out.get(name, 0.0) + value - before[name]


def thread_env(threads: int) -> dict[str, str]:
    n = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def mili_serve(
    model_dir: Path,
    dtype: str,
    threads: int,
    attention: str,
    extra: list[str],
    *,
    metrics: bool = False,
    frontends: int | None = 1,
    tree: Path = ROOT,
) -> Iterator[Served]:
    """`mili serve` on free ports; yields once the frontends are listening; drains it on exit.

    tree: the source tree it runs from (its working directory and PYTHONPATH; another checkout
    to measure a change side by side).

    metrics: every child serves Prometheus metrics on a free port (--metrics-port 0), their
    URLs in Served.metrics, read from the launcher's summary lines on stdout.
    frontends: `mili serve --frontends`, all on Served.address (`mili bench`'s clients, one
    connection each, spread over them); None: mili serve's default for the device.
    """
    command = [sys.executable, "-m", "mili", "serve", "--model", str(model_dir), "--port", "0"]
    command += ["--attention", attention, "--http-port", "0"]
    command += [] if frontends is None else ["--frontends", str(frontends)]
    command += ["--dtype", dtype, "--log-level", "WARNING", *extra]
    if metrics:
        command += ["--metrics-port", "0"]
    with tempfile.TemporaryFile("w+") as log:  # children's logs: shown only if start-up fails
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=tree,
            env={**thread_env(threads), "PYTHONPATH": str(tree)},
            # a benchmark killed (a piece's timeout) must not leave `mili serve` holding the
            # device's memory and ports for the next piece: it drains and stops with us
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        try:
            assert proc.stdout is not None
            address = None
            urls = {}
            children = {}
            for line in proc.stdout:
                if line.startswith("frontend service listening on "):
                    address = line.split()[-1]
                    break
                # `mili serve: <name> <address> pid N [http URL] [metrics URL]`
                words = line.split()
                if words[:2] == ["mili", "serve:"] and words[4:5] == ["pid"]:
                    children[words[2]] = words[3]
                    if "metrics" in words[3:-1]:
                        urls[words[2]] = words[words.index("metrics", 3) + 1]
            if address is None:
                log.seek(0)
                tail = "".join(log.readlines()[-30:])
                raise RuntimeError(f"mili serve in {tree} exited {proc.wait()}:\n{tail}")
            yield Served(address, proc, log, urls, children)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench_args(
    address: str,
    concurrency: int,
    num_requests: int,
    prompt: int,
    output: int,
    seed: int = 0,
    processes: int = 1,
) -> argparse.Namespace:
    return argparse.Namespace(
        address=address,
        concurrency=concurrency,
        num_requests=num_requests,
        request_rate=None,  # closed loop
        connections=None,  # one per client, at most 64: several frontends behind one port
        processes=processes,  # client processes (mili bench --processes)
        prompt_tokens=prompt,
        output_tokens=output,
        token_id_range=TOKEN_ID_RANGE,
        seed=seed,
        timeout=600.0,
        max_retries=0,  # a measurement: a refused request is an error, not a retry
    )


def run_bench(ns: argparse.Namespace) -> dict[str, Any]:
    summary = asyncio.run(client.bench(ns))
    if summary["num_errors"]:
        raise RuntimeError(f"requests failed: {summary['errors']}")
    return summary


class BareDecode:
    """One sequence on the bare model, batch 1: `prompt` prefilled, then decode steps on demand.

    A step is what the decode service's batch thread does per step besides its bookkeeping:
    DecodeBatch.build + model.decode + Sampler (greedy), feeding back the sampled token.
    """

    def __init__(self, model: Qwen3ForCausalLM, prompt: list[int], max_steps: int) -> None:
        self.model, self.prompt = model, prompt
        num_blocks = -(-(len(prompt) + max_steps + 1) // BLOCK_SIZE)
        self.cache = KVCache(model.config, num_blocks, BLOCK_SIZE, dtype=model.dtype)
        self.table = list(range(num_blocks))
        params = SamplingParams(temperature=0.0, max_tokens=max_steps + 1, ignore_eos=True)
        self.sampling = SequenceSampling(params, prompt, model.config.vocab_size)
        self.sampler = Sampler()
        with torch.inference_mode():
            batch = PrefillBatch.build([prompt], [self.table], BLOCK_SIZE)
            logits = model.prefill(batch, self.cache)
            self.sampling.append(self.sampler(logits, [self.sampling]).token_ids[0])

    @torch.inference_mode()
    def step(self, cpu_clock: Callable[[], float]) -> tuple[float, float, float]:
        """(model.decode s, whole step s, whole step CPU s)."""
        cpu_start, start = cpu_clock(), time.perf_counter()
        position = len(self.prompt) + len(self.sampling.output_token_ids) - 1
        token = self.sampling.output_token_ids[-1]
        batch = DecodeBatch.build([token], [position], [self.table], BLOCK_SIZE)
        t0 = time.perf_counter()
        logits = self.model.decode(batch, self.cache)
        t1 = time.perf_counter()
        self.sampling.append(self.sampler(logits, [self.sampling]).token_ids[0])
        return t1 - t0, time.perf_counter() - start, cpu_clock() - cpu_start
