"""Common gRPC server plumbing shared by every MILI service.

- `server`: `RpcServer` (grpc.aio + health + reflection + graceful drain) and `serve_forever`.
- `interceptor`: exception -> status mapping, in-flight counting, refusing calls while draining.
- `policy`: each method's request size limit and callers, enforced by the interceptor.
- `malformed`: request messages over their method's limit (RESOURCE_EXHAUSTED) or whose bytes
  do not parse (INVALID_ARGUMENT), refused by the interceptor before parsing.
- `heap`: freed heap memory given back to the OS once a burst of large requests is over.
- `status`: domain errors -> gRPC codes with `google.rpc` details, and readers for clients.
- `client`: channel options, `insecure_channel`, `wait_for_serving`.
"""

from __future__ import annotations

from mili.rpc.client import channel_options, insecure_channel, wait_for_serving
from mili.rpc.server import RpcServer, ServerConfig, serve_forever
from mili.rpc.status import bad_request_of, details_of, retry_info_of, status_of

__all__ = [
    "RpcServer",
    "ServerConfig",
    "bad_request_of",
    "channel_options",
    "details_of",
    "insecure_channel",
    "retry_info_of",
    "serve_forever",
    "status_of",
    "wait_for_serving",
]
