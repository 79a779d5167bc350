"""KV hand-off and TTFT between network namespaces ("hosts") next to within one, in one run.

Two deployments side by side, each a prefill and a decode instance (real `mili serve-*`
processes in network namespaces made with tests/netns.py, as tests/e2e/test_topology.py does)
and a frontend in this namespace; one tokenizer here serves both:

  same     prefill and decode in ONE namespace: KV goes over that namespace's loopback
  across   prefill and decode each in its own namespace: KV crosses veth -> bridge -> veth

Requests alternate between the two (same, across, same, ...), one at a time, so load from
other processes on a shared machine hits both alike; the result is each side's median and the
ratio across / same. Every request is a prompt of --prompt-tokens fresh random ids (prefix
caching off, so every prompt's whole KV moves) and --output-tokens tokens, greedy.

  TTFT       client side: Generate sent -> first token received (includes tokenize-free
             routing, prefill compute and the whole KV hand-off)
  KV GB/s    prefill's own measure (PrefillResponse.kv_bytes / transfer_ms, first chunk
             written -> decode's acknowledgement), from the frontend's per-request log line;
             layer-by-layer streaming overlaps the transfer with the compute of the later
             layers, so transfer_ms includes most of prefill's compute (shown beside it): the
             ratio across / same is the transport's share, not the absolute GB/s

KV path alone (--kv-path-tokens, default 512; 0 skips it): the transport without the compute
it hides behind. benchmarks/kv_handoff.py's sender in this process streams already-computed
KV of Qwen3-0.6B's shapes (random weights, bf16, 112 KiB per token: 58.7 MB for 512 tokens)
into a real `mili serve-decode`, alternately one on 127.0.0.1 here (same namespace) and one in
a namespace of its own (across: this namespace -> bridge -> veth); plaintext, as kv_handoff.py.

--tls (default on) gives prefill, decode, tokenizer and frontend certificates from a throwaway
CA, mTLS between all of them, as the multi-host test runs; the client talks plaintext to the
frontends (--public-tls off). Needs root (network namespaces); says why and exits 2 otherwise.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/topology.py
    .venv/bin/python benchmarks/topology.py --prompt-tokens 1024 --no-tls --json r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.netns, as a script

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.rpc.certs import Authority, CertFiles
from tests import netns
from tests.service_process import ServiceProcess

PREFILL_PORT, DECODE_PORT = 50061, 50071
_DONE = re.compile(r"(\S+) \(id \S+\) done: .* compute ([\d.]+) ms, KV (\d+) B in ([\d.]+) ms")


@dataclass
class Deployment:
    name: str
    prefill: ServiceProcess
    decode: ServiceProcess
    frontend: ServiceProcess

    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        return generation_pb2_grpc.GenerationServiceStub(
            grpc.insecure_channel(self.frontend.address)
        )


def _tls(files: CertFiles | None) -> tuple[str, ...]:
    if files is None:
        return ()
    return ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))


def _stop(services: list[ServiceProcess]) -> None:
    for service in services:
        if service.proc.poll() is None:
            try:
                service.terminate(timeout_s=30)
            except Exception:
                service.proc.kill()


@contextmanager
def deployment(
    name: str,
    prefill_host: netns.Host,
    decode_host: netns.Host,
    tokenizer: str,
    model: tuple[str, ...],
    files: CertFiles | None,
) -> Iterator[Deployment]:
    tls = _tls(files)
    prefill_address = f"{prefill_host.ip}:{PREFILL_PORT}"
    decode_address = f"{decode_host.ip}:{DECODE_PORT}"
    engine = (*model, "--no-prefix-cache", *tls)
    started: list[ServiceProcess] = []
    try:
        for host, argv in (
            (
                prefill_host,
                ("serve-prefill", "--port", str(PREFILL_PORT), "--decode", decode_address),
            ),
            # --prefill: without TLS decode accepts KV only from there (another namespace is not
            # "this machine"); with mTLS the certificate decides.
            (
                decode_host,
                ("serve-decode", "--port", str(DECODE_PORT), "--prefill", prefill_address),
            ),
        ):
            started.append(
                ServiceProcess(
                    *argv,
                    "--host",
                    host.ip,
                    *engine,
                    timeout_s=300,
                    prefix=host.command([]),
                )
            )
        frontend = ServiceProcess(
            "serve-frontend",
            "--port",
            "0",
            "--tokenizer",
            tokenizer,
            "--prefill",
            prefill_address,
            "--decode",
            decode_address,
            "--public-tls",
            "off",
            *tls,
            timeout_s=120,
        )
        started.append(frontend)
        d = Deployment(name, started[0], started[1], frontend)
        _wait_routable(d)
        yield d
    finally:
        _stop(started[::-1])


def _wait_routable(d: Deployment, timeout_s: float = 60.0) -> None:
    stub = d.stub()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stub.Info(generation_pb2.InfoRequest(), timeout=5).max_context_tokens > 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{d.name}: the frontend never saw its prefill/decode pair up")


def one_request(d: Deployment, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    request = generation_pb2.GenerateRequest(
        token_ids=[rng.randrange(3, 800) for _ in range(args.prompt_tokens)],
        sampling=sampling_pb2.SamplingParams(
            max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True
        ),
        request_id=f"{d.name}-{rng.getrandbits(48):x}",
    )
    started = time.perf_counter()
    ttft_s = None
    for response in d.stub().Generate(request, timeout=300):
        if ttft_s is None and response.token_ids:
            ttft_s = time.perf_counter() - started
    assert ttft_s is not None
    compute_ms, kv_bytes, transfer_ms = _kv_of(d.frontend, request.request_id)
    return {
        "ttft_ms": ttft_s * 1e3,
        "compute_ms": compute_ms,
        "kv_bytes": kv_bytes,
        "transfer_ms": transfer_ms,
        "kv_gb_per_s": kv_bytes / (transfer_ms * 1e6),
    }


def _kv_of(
    frontend: ServiceProcess, request_id: str, timeout_s: float = 10.0
) -> tuple[float, int, float]:
    """Prefill's compute ms, KV bytes and transfer ms from the frontend's log line for
    `request_id`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in reversed(frontend.stderr_lines):
            match = _DONE.search(line)
            if match and match.group(1) == repr(request_id):
                return float(match.group(2)), int(match.group(3)), float(match.group(4))
        time.sleep(0.02)
    raise RuntimeError(f"no log line for {request_id}")


async def kv_path(args: argparse.Namespace, net: netns.Network) -> dict[str, Any]:
    """Median GB/s of the KV path alone into a decode here and into one in a namespace."""
    import torch

    from benchmarks.kv_handoff import (
        BLOCK_SIZE,
        decode_reservation,
        kv_path_alone,
        prefill_in_process,
    )
    from benchmarks.presets import preset_checkpoint
    from mili.rpc.client import insecure_channel

    torch.set_num_threads(args.threads)  # the sender's encode threads compete with decode
    path = preset_checkpoint("qwen3-0.6b", args.cache_dir)
    _, servicer, prompt, num_blocks = prefill_in_process(path, args.kv_path_tokens)
    host = net.add_host("kvdec")
    decode: tuple[str, ...] = ("serve-decode", "--model", str(path))
    decode += ("--num-blocks", str(2 * num_blocks + 8))
    decode += ("--block-size", str(BLOCK_SIZE), "--dtype", "bfloat16", "--log-level", "WARNING")
    decode += ("--no-prefix-cache",)  # the same prompt every run: it must move in full each time
    services: list[ServiceProcess] = []
    runs: dict[str, list[float]] = {"same": [], "across": []}
    _progress("KV path: starting two decode instances")
    try:
        services.append(ServiceProcess(*decode, "--port", "0", timeout_s=300))
        # --prefill: decode in plaintext takes KV only from there; we dial from the bridge.
        services.append(
            ServiceProcess(
                *decode, "--host", host.ip, "--port", str(DECODE_PORT),
                "--prefill", f"{net.gateway}:1", timeout_s=300, prefix=host.command([]),
            )
        )  # fmt: skip
        targets = dict(zip(runs, services, strict=True))
        _progress("KV path: measuring")
        for i in range(args.warmup + args.kv_path_repeats):
            for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
                address = targets[name].address
                async with insecure_channel(address) as channel:
                    reserve = decode_reservation(channel, prompt, servicer.layout)
                    [(seconds, num_bytes)] = await kv_path_alone(
                        servicer, address, reserve, prompt, 1
                    )
                if i >= args.warmup:
                    runs[name].append(num_bytes / seconds / 1e9)
    finally:
        _stop(services)
        await servicer.close()
    result: dict[str, Any] = {
        name: {"gb_per_s": statistics.median(r), "runs": [round(x, 3) for x in r]}
        for name, r in runs.items()
    }
    result["kv_mb"] = num_bytes / 1e6
    result["ratio_across_over_same"] = result["across"]["gb_per_s"] / result["same"]["gb_per_s"]
    # Each pair ran back to back: the median of their ratios is the least noisy comparison.
    pairs = zip(runs["same"], runs["across"], strict=True)
    result["paired_ratio_median"] = statistics.median(a / s for s, a in pairs)
    return result


def _progress(what: str) -> None:
    print(
        f"benchmarks/topology.py: {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True
    )


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from mili.demo.model import default_model_dir

    model_dir = args.model or default_model_dir()
    model = ("--model", str(model_dir), "--dtype", args.dtype, "--attention", "torch")
    load_before = os.getloadavg()
    with ExitStack() as stack:
        net = stack.enter_context(netns.Network())
        same = net.add_host("same")
        prefill_host, decode_host = net.add_host("pre"), net.add_host("dec")
        files = None
        if args.tls:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            ips = [same.ip, prefill_host.ip, decode_host.ip]
            files = Authority().write(directory, "services", ["localhost", "127.0.0.1", *ips])
        tokenizer = stack.enter_context(
            _service("serve-tokenizer", "--model", str(model_dir), "--port", "0", *_tls(files))
        )
        deployments = [
            stack.enter_context(deployment("same", same, same, tokenizer.address, model, files)),
            stack.enter_context(
                deployment("across", prefill_host, decode_host, tokenizer.address, model, files)
            ),
        ]
        _progress("serving: measuring")
        rng = random.Random(args.seed)
        runs: dict[str, list[dict[str, float]]] = {d.name: [] for d in deployments}
        for i in range(args.warmup + args.requests):
            for d in deployments if i % 2 == 0 else deployments[::-1]:
                run = one_request(d, rng, args)
                if i >= args.warmup:
                    runs[d.name].append(run)
        path = asyncio.run(kv_path(args, net)) if args.kv_path_tokens else None
    assert netns.leftovers(net.tag, net.prefix) == []
    result: dict[str, Any] = {name: summarize(r) for name, r in runs.items()}
    result["kv_path"] = path
    result["ratio_across_over_same"] = {
        key: result["across"][key] / result["same"][key]
        for key in ("ttft_ms", "compute_ms", "transfer_ms", "kv_gb_per_s")
    }
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    result["settings"] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"
    }
    return result


@contextmanager
def _service(*argv: str) -> Iterator[ServiceProcess]:
    service = ServiceProcess(*argv, timeout_s=120)
    try:
        yield service
    finally:
        _stop([service])


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{'':8} {'TTFT ms':>9} {'compute ms':>11} {'KV MB':>8} {'transfer ms':>12} {'KV GB/s':>8}"
    ]
    for name in ("same", "across"):
        r = result[name]
        lines.append(
            f"{name:8} {r['ttft_ms']:9.1f} {r['compute_ms']:11.1f} {r['kv_bytes'] / 1e6:8.2f} "
            f"{r['transfer_ms']:12.1f} "
            f"{r['kv_gb_per_s']:8.3f}"
        )
    ratio = result["ratio_across_over_same"]
    lines.append(
        f"{'across/same':12} TTFT {ratio['ttft_ms']:.3f}x, transfer {ratio['transfer_ms']:.3f}x, "
        f"GB/s {ratio['kv_gb_per_s']:.3f}x"
    )
    path = result["kv_path"]
    if path is not None:
        lines.append(
            f"KV path alone ({path['kv_mb']:.1f} MB, plaintext): "
            f"same {path['same']['gb_per_s']:.3f} GB/s, "
            f"across {path['across']['gb_per_s']:.3f} GB/s, across/same "
            f"{path['ratio_across_over_same']:.3f}x (median of paired runs "
            f"{path['paired_ratio_median']:.3f}x)"
        )
    load = result["load_average"]
    lines.append(
        "load average (1/5/15 min) before "
        + "/".join(f"{x:.2f}" for x in load["before"])
        + ", after "
        + "/".join(f"{x:.2f}" for x in load["after"])
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=2)
    parser.add_argument("--requests", type=int, default=20, help="measured per deployment")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per service")
    parser.add_argument("--kv-path-tokens", type=int, default=512, help="0: skip the KV path")
    parser.add_argument("--kv-path-repeats", type=int, default=11)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/mili/bench")
    parser.add_argument("--no-tls", dest="tls", action="store_false", help="plaintext instead")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason is not None:
        print(f"benchmarks/topology.py: cannot run: {reason}", file=sys.stderr)
        sys.exit(2)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the children inherit these
        os.environ[name] = str(args.threads)
    result = measure(args)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
