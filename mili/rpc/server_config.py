"""How a service's gRPC server listens and shuts down (`ServerConfig`, built once from its
flags), and its TLS (`ServerTls`)."""

from __future__ import annotations

from dataclasses import dataclass

from mili.rpc.tls import Tls


@dataclass(frozen=True)
class ServerTls:
    """The port speaks TLS with `tls.cert`; `require_client_auth`: only clients holding a
    certificate `tls.ca` signed complete the handshake (mTLS)."""

    tls: Tls
    require_client_auth: bool


@dataclass(frozen=True)
class ServerConfig:
    """How a service's gRPC server listens and shuts down."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port; `RpcServer.start` returns the one bound
    # Largest message sent, and received unless max_receive_message_bytes is set. KV chunks
    # between prefill and decode are megabytes each.
    max_message_bytes: int = 64 * 1024 * 1024
    # Largest request message accepted, when tighter than max_message_bytes (the frontend's
    # public port: its largest valid request is a few MB, its replies can be tens). Each method
    # has its own limit too (mili.rpc.policy): grpc is told the largest of them, capped by this,
    # and refuses a larger message with RESOURCE_EXHAUSTED from its length prefix, unread.
    max_receive_message_bytes: int | None = None
    # Per-call receive window (HTTP/2 flow control). None: grpc grows it with its bandwidth
    # probe, which the megabyte KV chunks prefill streams to decode want; but then a client can
    # push tens of MB of a message grpc is about to refuse, and the process keeps the buffers
    # (+130 MiB of RSS after ten 60 MB prompts). A number fixes it (probe off), bounding that.
    receive_window_bytes: int | None = None
    drain_timeout_s: float = 30.0  # how long in-flight calls get to finish after SIGTERM
    grace_s: float = 5.0  # grpc's own server.stop(grace) after draining
    metrics_port: int | None = None  # Prometheus /metrics on host:metrics_port; None = off, 0 = any
    # grpc.health.v1 alone, plaintext, on host:health_port (None = off, 0 = any): for probes
    # that cannot speak TLS, such as Kubernetes' grpc probes.
    health_port: int | None = None
    tls: ServerTls | None = None  # None: plaintext
    # SO_REUSEPORT: this port is shared with other processes of this user that set it too (the
    # frontends of `mili serve --frontends N`); the kernel spreads connections over them.
    # False: a second process on the port fails to bind instead of silently sharing it.
    reuse_port: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")
        # grpc takes its byte limits as C ints: 2^31 or more was an OverflowError at bind.
        if not 0 < self.max_message_bytes < 2**31:
            raise ValueError(
                f"max_message_bytes must be in (0, 2^31), got {self.max_message_bytes}"
            )
        receive = self.max_receive_message_bytes
        if receive is not None and not 0 < receive < 2**31:
            raise ValueError(f"max_receive_message_bytes must be in (0, 2^31), got {receive}")
        window = self.receive_window_bytes
        if window is not None and not 0 < window < 2**31:
            raise ValueError(f"receive_window_bytes must be in (0, 2^31), got {window}")
        if not self.drain_timeout_s >= 0:  # (NaN too: it skipped the drain)
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be in [0, 65535], got {self.health_port}")
        if self.tls is not None:
            self.tls.tls.server_credentials(require_client_auth=self.tls.require_client_auth)

    @property
    def receive_limit(self) -> int:
        """The largest message the server accepts, in bytes."""
        receive = self.max_receive_message_bytes
        return self.max_message_bytes if receive is None else receive
