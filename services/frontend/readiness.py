"""Whether this frontend can serve a request: the one rule behind both its grpc.health.v1
status and HTTP `GET /health`.

    model_loaded     the tokenizer answered (its vocabulary and file are loaded here) and at
                     least one decode instance is up: its Info answered, with the model it runs
    scheduler_ready  some routable prefill instance and routable decode instance (up, not
                     draining) form a pair whose KV layouts match: a request has a route
    serving          the tokenizer is up and the scheduler is ready (which implies
                     model_loaded); gRPC SERVING, HTTP 200

Computed by Backends after each round of Info polls (as of the last poll, not between polls),
so both APIs read the same snapshot. A draining frontend is not serving either way: that is
each port's own state (RpcServer, HttpServer), not the backends'.
"""

from __future__ import annotations

from typing import NamedTuple

from services.frontend.router import Router


class Readiness(NamedTuple):
    model_loaded: bool
    scheduler_ready: bool
    problem: str | None  # why a request would fail now; None when it can be served

    @property
    def is_serving(self) -> bool:
        return self.problem is None


# Before the first round of polls: nothing is known to be up.
NOT_POLLED = Readiness(False, False, "the services behind the frontend are not polled yet")


def readiness_of(router: Router, *, is_tokenizer_up: bool, tokenizer_address: str) -> Readiness:
    route_problem = router.route_problem()
    is_decode_up = any(view.is_up for view in router.decodes.values())
    if not is_tokenizer_up:
        problem: str | None = f"the tokenizer at {tokenizer_address} is down"
    else:
        problem = route_problem
    return Readiness(
        model_loaded=is_tokenizer_up and is_decode_up,
        scheduler_ready=route_problem is None,
        problem=problem,
    )
