"""The whole pipeline as real processes on port 0: tokenizer, prefill(s), decode(s), frontend.

Processes of one deployment start in parallel (each loads torch and the demo model; on two
cores that is most of an e2e test's time), the frontend last, with the others' addresses.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.ports import pick_free_ports
from tests.service_process import ServiceProcess

if TYPE_CHECKING:
    import torch

# Small KV pools: the defaults (1 GiB per decode instance) are for real serving, not for tests.
DECODE_ARGS = ("--num-blocks", "1024")
PREFILL_ARGS = ("--num-blocks", "512")


def start_all(specs: Sequence[Sequence[str]]) -> list[ServiceProcess]:
    """Start `mili ARGS...` for every spec at once; all or none (a failed start stops the rest)."""
    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        futures = [pool.submit(ServiceProcess, *spec) for spec in specs]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for service in started:
            service.proc.kill()
        raise errors[0]  # type: ignore[misc]
    return started


@dataclass
class Deployment:
    tokenizer: ServiceProcess
    prefills: list[ServiceProcess]
    decodes: list[ServiceProcess]
    frontend: ServiceProcess
    owns_tokenizer: bool = False
    # Addresses the prefill instances may also send KV to, for stand-ins started later (a
    # fault proxy in front of a decode instance binds one of these).
    spare_decode_addresses: list[str] = field(default_factory=list)
    _channels: list[grpc.Channel] = field(default_factory=list)

    def channel(self, address: str | None = None) -> grpc.Channel:
        channel = grpc.insecure_channel(address or self.frontend.address)
        self._channels.append(channel)
        return channel

    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        return generation_pb2_grpc.GenerationServiceStub(self.channel())

    def free_blocks(self, services: Sequence[ServiceProcess] | None = None) -> dict[str, int]:
        """num_free_blocks of every (or the given) prefill and decode instance, by address."""
        wanted = list(services) if services is not None else [*self.prefills, *self.decodes]
        counts = {}
        for service in wanted:
            with grpc.insecure_channel(service.address) as channel:
                if service in self.decodes:
                    info = decode_pb2_grpc.DecodeServiceStub(channel).Info(
                        decode_pb2.InfoRequest(), timeout=5
                    )
                else:
                    info = prefill_pb2_grpc.PrefillServiceStub(channel).Info(
                        prefill_pb2.InfoRequest(), timeout=5
                    )
            counts[service.address] = info.num_free_blocks
        return counts

    def settled_free_blocks(self, timeout_s: float = 10.0) -> dict[str, int]:
        """`free_blocks` once earlier requests are gone: no decode instance runs or queues one,
        and two reads 0.2 s apart agree. A test's starting count: a request the frontend ended
        (a stop string, a cancel, a deadline) frees its decode blocks a moment after its caller
        saw the end, so a count read at once can still hold them."""
        deadline = time.monotonic() + timeout_s
        last = self.free_blocks()
        while True:
            time.sleep(0.2)
            counts = self.free_blocks()
            infos = [self.decode_info(i) for i in range(len(self.decodes))]
            if counts == last and all(i.num_running == i.num_waiting == 0 for i in infos):
                return counts
            if time.monotonic() > deadline:
                pytest.fail(f"the deployment did not settle: free KV blocks {last} -> {counts}")
            last = counts

    def prefill_info(self, index: int = 0) -> prefill_pb2.InfoResponse:
        with grpc.insecure_channel(self.prefills[index].address) as channel:
            return prefill_pb2_grpc.PrefillServiceStub(channel).Info(
                prefill_pb2.InfoRequest(), timeout=5
            )

    def decode_info(self, index: int = 0) -> decode_pb2.InfoResponse:
        with grpc.insecure_channel(self.decodes[index].address) as channel:
            return decode_pb2_grpc.DecodeServiceStub(channel).Info(
                decode_pb2.InfoRequest(), timeout=5
            )

    def wait_free_blocks(
        self,
        expected: dict[str, int],
        services: Sequence[ServiceProcess] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        """Wait until the free counts are back to `expected`; fail showing the last counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.free_blocks(services)
            if counts == expected:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"free KV blocks did not recover: {counts}, expected {expected}")
            time.sleep(0.05)

    def wait_until_routable(self, timeout_s: float = 20.0) -> None:
        """The frontend serves before its first Info poll is in: wait until it has a route."""
        stub = self.stub()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = stub.Info(generation_pb2.InfoRequest(), timeout=5)
            if info.max_context_tokens > 0:
                return
            time.sleep(0.1)
        pytest.fail("the frontend never saw a decode instance up")

    def stop(self) -> None:
        for channel in self._channels:
            channel.close()
        stages = [[self.frontend], [*self.prefills, *self.decodes]]
        if self.owns_tokenizer:
            stages.append([self.tokenizer])
        for stage in stages:
            for service in stage:
                if service.proc.poll() is None:
                    service.proc.send_signal(15)
            for service in stage:
                try:
                    service.terminate(timeout_s=30)
                except Exception:
                    service.proc.kill()


def deploy(
    model_dir: Path,
    tokenizer: ServiceProcess,
    *,
    num_prefills: int = 1,
    num_decodes: int = 1,
    engine_args: Sequence[str] = (),
    prefill_args: Callable[[int], Sequence[str]] = lambda i: (),
    decode_args: Sequence[str] = DECODE_ARGS,
    frontend_args: Sequence[str] = (),
    num_spare_decodes: int = 0,
) -> Deployment:
    """Prefill and decode instances (with `engine_args` each, e.g. a dtype) and a frontend.

    Decode ports are picked first, as `mili serve` does: each prefill instance is told the
    decode instances it may send KV to (plus `num_spare_decodes` addresses for stand-ins).
    """
    model = ("--model", str(model_dir), *engine_args)
    decode_ports = pick_free_ports("127.0.0.1", num_decodes + num_spare_decodes)  # distinct
    decode_addresses = [f"127.0.0.1:{port}" for port in decode_ports]
    allowed = ("--decode", ",".join(decode_addresses))
    specs = [
        ("serve-prefill", *model, "--port", "0", *PREFILL_ARGS, *allowed, *prefill_args(i))
        for i in range(num_prefills)
    ]
    specs += [
        ("serve-decode", *model, "--port", str(port), *decode_args)
        for port in decode_ports[:num_decodes]
    ]
    services = start_all(specs)
    prefills, decodes = services[:num_prefills], services[num_prefills:]
    try:
        frontend = ServiceProcess(
            "serve-frontend",
            "--port",
            "0",
            "--tokenizer",
            tokenizer.address,
            "--prefill",
            ",".join(p.address for p in prefills),
            "--decode",
            ",".join(d.address for d in decodes),
            "--poll-interval",
            "0.5",
            *frontend_args,
        )
    except Exception:
        for service in services:
            service.proc.kill()
        raise
    deployment = Deployment(
        tokenizer,
        prefills,
        decodes,
        frontend,
        spare_decode_addresses=decode_addresses[num_decodes:],
    )
    deployment.wait_until_routable()
    return deployment


@pytest.fixture(scope="session")
def e2e_tokenizer(demo_model_dir: Path) -> Iterator[ServiceProcess]:
    service = ServiceProcess("serve-tokenizer", "--model", str(demo_model_dir), "--port", "0")
    yield service
    assert service.terminate() == 0, service.stderr


@pytest.fixture(scope="session")
def pipeline(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    """One prefill, one decode and a frontend, in float32: the demo model's next-token
    distributions are nearly flat, and in bfloat16 a near-tie (log-prob gap ~0.004) flips with
    the batch a prompt is prefilled in, in the single-process reference as much as in the
    services; float32 keeps greedy comparisons exact."""
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        engine_args=("--dtype", "float32"),
        num_spare_decodes=1,
        frontend_args=("--http-port", "0"),  # the README's HTTP examples run against it
    )
    yield d
    d.stop()


# The services run the Mojo kernels, HF its eager attention: float32 rounding apart, the same.
HF_TOL = 2e-4


@pytest.fixture(scope="session")
def hf_logprobs(demo_model_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """HF transformers' prompt logprobs on the demo model in float32, the oracle of the
    services' (`pipeline` runs float32 too)."""
    import torch

    transformers = pytest.importorskip("transformers")
    from mili.engine.model.loader import tokenizer_vocab_size

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        hf = transformers.Qwen3ForCausalLM.from_pretrained(
            demo_model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    vocab_size = tokenizer_vocab_size(demo_model_dir) or hf.config.vocab_size

    def logprobs(prompt: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row i - 1 is the distribution of prompt token i, normalized
        over all the model's rows and read at the tokenizer's ids (the ones the services
        report)."""
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
        return logits.log_softmax(-1)[:, :vocab_size]

    return logprobs


def hf_rank_bounds(row: torch.Tensor, token: int) -> tuple[int, int]:
    """The ranks (vLLM's: the entries whose logprob is >= the token's, itself included)
    `token` may have in HF's `row`, given HF_TOL of rounding between the two: entries within
    it of the token's may fall either side."""
    value = row[token].item()
    return int((row > value + HF_TOL).sum()) + 1, int((row >= value - HF_TOL).sum())


def served_model(url: str) -> str:
    """The model name the frontend's HTTP API at `url` serves (its first)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])


def end_lines(prefix: str) -> re.Pattern[str]:
    """The frontend's one log line of a request whose caller's id is `prefix-N`: how it ended,
    a finish reason (`finish`), a status code (`code`, with the output tokens it had: `made`)
    or a cut (`cut`: the caller cancelled, or its deadline passed). A retried request's reasons
    hold status codes of their own: the pattern steps over them."""
    return re.compile(
        rf"'(?P<rid>{prefix}-[\d.]+)' \(id \S+\) (?:done: .*?, finish (?P<finish>\w+),"
        r"|failed after [\d.]+ ms(?:, (?P<made>\d+) output tokens?)?(?: \(retried .*\))?: "
        r"(?P<code>[A-Z_]+): |(?P<cut>[A-Z][A-Z_]+) after )"
    )


@pytest.fixture(scope="session")
def engine_greedy(demo_model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """The single-process engine's greedy tokens of a prompt alone, on the demo model in
    float32 (as the deployments here run it); the oracle of a deployment's greedy answers."""
    import torch

    from mili.engine.generate import generate
    from mili.engine.model.loader import load_model, tokenizer_vocab_size
    from mili.engine.sampling_params import SamplingParams

    model = load_model(demo_model_dir, dtype=torch.float32)
    vocab_size = tokenizer_vocab_size(demo_model_dir)
    done: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int], max_tokens: int) -> list[int]:
        """The greedy tokens of `prompt` alone (greedy: a shorter run is a prefix of a longer)."""
        key = tuple(prompt)
        if len(done.get(key, ())) < max_tokens:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # beside the services' processes (test_pipeline.py)
            try:
                done[key] = generate(model, [prompt], params, vocab_size=vocab_size)[0].token_ids
            finally:
                torch.set_num_threads(threads)
        return done.get(key, [])[:max_tokens]

    return tokens
