"""Who may push KV into decode's reserved blocks: on a plaintext port only the hosts of the
configured prefill instances (here a DNS name, looked up again on a miss); on an mTLS port only
holders of a certificate the CA signed. A refused transfer lands nothing: the same reservation
then completes from a trusted sender, with the tokens of single-process generation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

import grpc

from mili.discovery import Callers, PeerSet, parse_targets
from mili.engine.engine_config import EngineConfig
from mili.engine.sampling_params import SamplingParams
from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.certs import Authority, CertFiles
from mili.rpc.client import channel, insecure_channel
from mili.rpc.server_config import ServerConfig, ServerTls
from mili.rpc.tls import Tls, TlsFiles
from services.decode.config import DecodeConfig
from tests.decode.conftest import BLOCK_SIZE, NUM_BLOCKS
from tests.decode.harness import (
    Client,
    DecodeServerThread,
    Outcome,
    PrefillPlayer,
    Reserved,
    random_prompt,
    sampling,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


async def _transfer(
    client: Client, messages: Sequence[kv_pb2.TransferKvRequest]
) -> kv_pb2.TransferKvResponse:
    call = client.kv.TransferKv(timeout=10)
    for message in messages:
        await call.write(message)
    await call.done_writing()
    reply: kv_pb2.TransferKvResponse = await call
    return reply


async def _refused(client: Client, messages: Sequence[kv_pb2.TransferKvRequest]) -> object:
    """Send the header and the first chunk; the call's status once decode ended it."""
    call = client.kv.TransferKv(timeout=10)
    # A write racing the end of the call fails with a status of its own: the call's is the one
    # decode sent.
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.write(messages[0])
        await asyncio.wait_for(asyncio.shield(call.code()), 0.5)
        await call.write(messages[1])
    return await asyncio.wait_for(call.code(), 5)


async def _refused_then_accepted(
    server: DecodeServerThread,
    player: PrefillPlayer,
    trusted: grpc.aio.Channel,
    untrusted: grpc.aio.Channel,
    code: grpc.StatusCode,
    before_retry: object = None,
) -> None:
    prompt = random_prompt(21, player.vocab_size, seed=7)
    client = Client(trusted)
    request = decode_pb2.GenerateRequest(
        request_id="peers", prompt_token_ids=prompt, sampling=sampling(GREEDY)
    )
    call, block_ids = await client.admit(request)
    prefilled = await asyncio.to_thread(player.prefill, prompt, GREEDY)
    messages = player.messages("peers", prompt, block_ids, prefilled)
    received = server.instance.metrics.kv_received_bytes
    assert await _refused(Client(untrusted), messages) == code
    assert received._value.get() == 0  # not one byte landed
    if callable(before_retry):
        before_retry()
    reply = await _transfer(client, messages)  # the reservation is as it was
    assert reply.num_blocks == len(Reserved(block_ids, ""))
    out = await client.collect(call, Outcome())
    assert out.token_ids == player.reference(prompt, GREEDY)


def _config(model_dir: Path) -> DecodeConfig:
    return DecodeConfig(
        model_dir=model_dir, engine=EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    )


def test_plaintext_kv_only_from_the_hosts_of_the_prefill_name(
    tiny_model_dir: Path, player: PrefillPlayer
) -> None:
    records = {"prefill.mili.test": ("127.0.0.9",)}  # not where our test client calls from

    async def resolve(host: str) -> tuple[str, ...]:
        return records.get(host, ())

    senders = PeerSet(parse_targets(["dns:///prefill.mili.test:50053"]), resolve=resolve, retry_s=0)
    server = DecodeServerThread(_config(tiny_model_dir), prefills=Callers("--prefill", senders))

    def prefill_moves_here() -> None:  # the prefill pod now runs on our address
        records["prefill.mili.test"] = ("127.0.0.9", "127.0.0.1")

    async def body() -> None:
        async with insecure_channel(server.address) as ch:
            await _refused_then_accepted(
                server, player, ch, ch, grpc.StatusCode.PERMISSION_DENIED, prefill_moves_here
            )

    try:
        server.run(body())
    finally:
        server.close()


def _tls(files: CertFiles) -> Tls:
    return TlsFiles(files.cert, files.key, files.ca).load()


def test_mtls_kv_only_from_certificates_the_ca_signed(
    tiny_model_dir: Path, player: PrefillPlayer, tmp_path: Path
) -> None:
    ours, theirs = Authority(), Authority("someone else's CA")
    decode = ours.write(tmp_path / "ours", "decode", ["127.0.0.1"])
    prefill = ours.write(tmp_path / "ours", "prefill", ["prefill"])
    stranger = theirs.write(tmp_path / "theirs", "prefill", ["prefill"])
    stranger_tls = TlsFiles(stranger.cert, stranger.key, decode.ca).load()  # trusts decode
    server_config = ServerConfig(
        tls=ServerTls(_tls(decode), require_client_auth=True), drain_timeout_s=2.0, grace_s=0.5
    )
    server = DecodeServerThread(
        _config(tiny_model_dir),
        server_config=server_config,
        # what serve-decode picks on an mTLS port
        prefills=Callers("--prefill", PeerSet((), is_any=True)),
    )

    async def body() -> None:
        async with (
            channel(server.address, tls=_tls(prefill)) as trusted,
            channel(server.address, tls=stranger_tls) as untrusted,
        ):
            await _refused_then_accepted(
                server, player, trusted, untrusted, grpc.StatusCode.UNAVAILABLE
            )

    try:
        server.run(body())
    finally:
        server.close()
