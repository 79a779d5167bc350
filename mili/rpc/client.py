"""Channels between MILI services (and from tests), and waiting for a peer to be SERVING."""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc

from mili.rpc.status import code_and_details
from mili.rpc.tls import Tls

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    receive_window_bytes: int | None = None,
    *,
    own_connection: bool = False,
) -> list[tuple[str, int]]:
    """grpc channel options: message limits matching the servers', plus keepalive.

    `receive_window_bytes`: a fixed HTTP/2 receive window (no BDP probing, which grows it to
    megabytes on a fast link): what the peer may send ahead of what we read. A stream that
    carries many requests' messages in order (decode's GenerateStream) wants it small, so that
    a backlog waits at the sender, merged, not queued in front of later messages here.

    Keepalive pings every 30 s (only while calls are open) let a long, quiet stream notice a
    dead peer in ~40 s instead of the kernel's TCP timeout; servers built by `RpcServer` accept
    pings that often.

    `own_connection`: a TCP connection of the channel's own; without it channels of one
    process with the same target and options share one (grpc's global subchannel pool), so
    they reach one of the processes behind a port shared with SO_REUSEPORT.

    Reconnect backoff is capped at 2 s (grpc's default grows to 120 s): a peer that died and
    came back on the same address (`mili serve` restarts it there) is reached again within
    seconds, not minutes, by a caller that kept trying meanwhile (the frontend's Info polls).
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
    window = []
    if receive_window_bytes is not None:
        window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", receive_window_bytes)]
    return [
        *window,
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging on streams with no data
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        *([("grpc.use_local_subchannel_pool", 1)] if own_connection else []),
    ]


def insecure_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    receive_window_bytes: int | None = None,
    own_connection: bool = False,
) -> grpc.aio.Channel:
    """A plaintext grpc.aio channel to `address` ("host:port"); close it when done.

    `interceptors`: e.g. tracing's (mili.telemetry.tracing); none keeps grpc's direct calls.
    """
    return grpc.aio.insecure_channel(
        address,
        options=channel_options(
            max_message_bytes, receive_window_bytes, own_connection=own_connection
        ),
        interceptors=list(interceptors) or None,
    )


def channel(
    address: str,
    *,
    tls: Tls | None = None,
    server_name: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    receive_window_bytes: int | None = None,
    own_connection: bool = False,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`: TLS when `tls` is given (verifying the server as
    `server_name`, default the address's host), else plaintext. `own_connection`: see
    channel_options."""
    if tls is None:
        return insecure_channel(
            address,
            max_message_bytes=max_message_bytes,
            interceptors=interceptors,
            receive_window_bytes=receive_window_bytes,
            own_connection=own_connection,
        )
    options: list[tuple[str, str | int]] = [
        *channel_options(max_message_bytes, receive_window_bytes, own_connection=own_connection)
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(),
        options=options,
        interceptors=list(interceptors) or None,
    )


def connection_hint(err: grpc.RpcError, *, is_tls: bool) -> str:
    """A sentence for an UNAVAILABLE that looks like a TLS mismatch (grpc only says "Socket
    closed" when a handshake was refused), else ""."""
    code, details = code_and_details(err)
    if code != grpc.StatusCode.UNAVAILABLE:
        return ""
    lowered = details.lower()
    if "hostname verification" in lowered:
        return (
            " (the server's certificate does not name the host dialed: its subject alternative"
            " names must include that host or IP, for mili serve its --host)"
        )
    if "certificate has expired" in lowered:
        return " (the server's certificate has expired: renew --tls-cert)"
    if "handshake" in lowered or "ssl" in lowered or "certificate" in lowered:
        return " (TLS handshake failed: check --tls-ca, --tls-cert and --tls-key)"
    if "socket closed" in lowered or "connection reset" in lowered:
        if is_tls:
            return (
                " (the server closed the connection during the TLS handshake: it refused our "
                "certificate, wants one (--tls-cert/--tls-key), or does not speak TLS)"
            )
        return " (the server closed the connection at once: does it require TLS? pass --tls-ca)"
    return ""


# grpc's details for a failed connection lead with what we already know (that it failed, the
# address): "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:5: ...".
_CONNECT_PREFIX = re.compile(
    r"^(failed to connect to all addresses; last error: )?([A-Z_]+: )?((ipv4|ipv6|unix):\S+: )?"
)


def brief_details(err: grpc.RpcError, limit: int = 200) -> str:
    """grpc's details of `err` without the connection boilerplate, cut to `limit` characters:
    what the last attempt met ("Connection refused", "Hostname Verification Check failed.")."""
    _, details = code_and_details(err)
    brief = _CONNECT_PREFIX.sub("", details.strip(), count=1)
    return brief if len(brief) <= limit else brief[: limit - 3] + "..."
