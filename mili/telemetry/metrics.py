"""Prometheus metrics: one registry per process, the metrics each service kind records, and the
HTTP endpoint that serves them.

Every metric lives in a `CollectorRegistry` made by the service's entry point and passed in
(never prometheus_client's global one), so tests that run several servers in one process do not
collide. Names start with `mili_` (prometheus_client's standard `process_*` aside), carry their
unit (`_seconds`, `_bytes`) and counters end in `_total`. What each service records, and where:

    every service  mili_requests_total{grpc_service,grpc_method,status}   mili.rpc.interceptor,
                   and mili_control_requests_total (Info, health, reflection), once per call;
                   process_* (RSS, CPU seconds, open fds; Linux)   mili.rpc.server
    frontend       requests in flight, tokens streamed, time to first token, time per output
                   token   services/frontend/server.py; instances by state and membership
                   changes   services/frontend/instances.py; the admission queue's depth
                   services/frontend/backends.py; waits in it   services/frontend/admitter.py
    frontend HTTP  mili_http_requests_total{route,method,status} and
                   mili_http_request_duration_seconds{route}, once per request on the HTTP
                   port: route is the route's template (/status/{request_id}) or `unmatched`,
                   method `_OTHER` past HTTP's own, status the code sent or 499 (the client
                   went away first)   services/frontend/http_api/telemetry.py
    prefill        step time and size, queue, KV blocks, KV sent, prefix cache   worker.py,
                   server.py
    decode         step time and batch size, queue, KV blocks, KV received   batcher.py, transfer.py

Recording stays off the per-token path: histograms are observed once per step or per request,
counters moved at most once per step or per response message, and gauges that mirror state
(free blocks, queue depth, requests in flight) are read by a callback at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mili.discovery import format_address
from mili.engine.kv.prefix_cache import PrefixCacheReading

# Bucket bounds (seconds unless noted), wide enough for a CPU test model and an H200 alike.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
HTTP_BUCKETS = (0.001, 0.0025, *LATENCY_BUCKETS, 120.0, 300.0)  # /v1/models to long streams
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # sequences
BATCH_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens
# A request's prompt or output length, up to the longest contexts Qwen3 has (tokens)
LENGTH_BUCKETS = (1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)

Read = Callable[[], float]


class MetricsServer:
    """The `/metrics` HTTP endpoint of one registry, served from a daemon thread on
    http://HOST:PORT/metrics (port 0: a free one, see `.port`)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self._httpd.set_app(_head_as_get(make_wsgi_app(registry)))
        self.host = host
        self.port: int = self._httpd.server_port  # the bound one when `port` was 0

    @property
    def url(self) -> str:
        return f"http://{format_address(self.host, self.port)}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def _head_as_get(app: WSGIApplication) -> WSGIApplication:
    """`app` answering HEAD as it answers GET, without the body. prometheus_client answers HEAD
    with a 405 and a body, which HTTP forbids: a client that checks the URL with HEAD before it
    scrapes (aiperf's --server-metrics probe, on aiohttp) takes that for a broken response and
    drops the endpoint, never trying GET."""

    def answer(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        got: list[tuple[str, list[tuple[str, str]]]] = []

        def keep(
            status: str, headers: list[tuple[str, str]], exc_info: object = None
        ) -> Callable[[bytes], object]:
            got.append((status, headers))
            return len  # WSGI's write(): unused, prometheus_client returns its body

        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, keep))
        status, headers = got[0]
        start_response(status, [*headers, ("Content-Length", str(len(body)))])
        return [b""]  # the GET's length, none of its bytes

    return answer


def _callback_gauge(registry: CollectorRegistry, name: str, documentation: str, read: Read) -> None:
    gauge = Gauge(name, documentation, registry=registry)
    gauge.set_function(read)


def split_method(method: str) -> tuple[str, str]:
    """`/pkg.Service/Method` -> ("pkg.Service", "Method"), the grpc_service and grpc_method
    labels (the names gRPC's Prometheus integrations use)."""
    service, _, name = method.removeprefix("/").rpartition("/")
    return service, name


class RequestMetrics:
    """Calls by service, method and final status; recorded by the server interceptor.

    Two counters, so that `sum(rate(mili_requests_total[1m]))` is the traffic a service
    serves without every dashboard having to filter: the frontend polls each instance's Info
    every --poll-interval and load balancers probe health, which would otherwise outnumber
    real requests on a quiet deployment and dilute its error ratio. Those calls are counted,
    by the same labels, in mili_control_requests_total.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_service", "grpc_method", "status"]
        self.requests = Counter(
            "mili_requests_total",
            "Application RPCs handled, by service, method and final gRPC status code name, or "
            "REQUEST_UNREAD when grpc ended the call before its one request message was read "
            "(over the receive limit, or cancelled first); Info, health and reflection are "
            "counted in mili_control_requests_total",
            labels,
            registry=registry,
        )
        self.control_requests = Counter(
            "mili_control_requests_total",
            "Info, health and reflection RPCs handled (polling by the frontend and load "
            "balancers), by service, method and final gRPC status code name",
            labels,
            registry=registry,
        )

    def record(self, method: str, status: str, *, is_control: bool = False) -> None:
        """Count one call to `method` (`/pkg.Service/Method`) that ended with `status`."""
        counter = self.control_requests if is_control else self.requests
        counter.labels(*split_method(method), status).inc()


def watch_process(registry: CollectorRegistry) -> None:
    """process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds and the
    rest of prometheus_client's process metrics (read from /proc at scrape time; none
    elsewhere). Call once per registry."""
    ProcessCollector(registry=registry)


class FrontendMetrics:
    """What a client sees: requests in flight, tokens streamed, latencies (once per request)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.generated_tokens = Counter(
            "mili_frontend_generated_tokens_total",
            "Generated token ids sent to clients (Generate's stream and Complete's reply); a "
            "request cut short counts what it sent",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "mili_frontend_prompt_tokens_total",
            "Prompt tokens of the requests tokenized (each of an HTTP request's n choices "
            "counts its prompt), whether they then finished or not",
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "mili_frontend_time_to_first_token_seconds",
            "From the frontend receiving a request to its first generated token being ready "
            "to send",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "mili_frontend_time_per_output_token_seconds",
            "Per request with at least 2 output tokens: (last token time - first token time) "
            "/ (output tokens - 1)",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )

        # Once per generation as it ends (each of an HTTP request's n choices is one).
        self.requests_finished = Counter(
            "mili_frontend_requests_finished_total",
            "Generations ended, by outcome: the finish reason of a whole answer (stop, length), "
            "or the gRPC status code name of one that failed or was cut short (CANCELLED: the "
            "caller went away; DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNAVAILABLE, ...)",
            ["outcome"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "mili_frontend_request_duration_seconds",
            "Per whole answer: from the frontend receiving the request to its last token (the "
            "end-to-end latency, queueing included)",
            buckets=HTTP_BUCKETS,
            registry=registry,
        )
        self.request_prompt_tokens = Histogram(
            "mili_frontend_request_prompt_tokens",
            "Per request tokenized: its prompt's length in tokens",
            buckets=LENGTH_BUCKETS,
            registry=registry,
        )
        self.request_output_tokens = Histogram(
            "mili_frontend_request_output_tokens",
            "Per whole answer: the tokens it generated",
            buckets=LENGTH_BUCKETS,
            registry=registry,
        )

        self.queue_wait = Histogram(
            "mili_frontend_queue_wait_seconds",
            "Time a request waited in the admission queue for room on a decode (or prefill) "
            "instance, observed as it left the queue (admitted, cancelled, deadline passed); "
            "requests that found room at once never enter it",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

        self.instance_changes = Counter(
            "mili_frontend_instance_changes_total",
            "Prefill and decode instances that joined (added), left with requests still on "
            "them (draining), left for good (dropped) or came back while draining (returned), "
            "as discovery saw them",
            ["kind", "change"],
            registry=registry,
        )

        # The HTTP port (services/frontend/http_api/telemetry.py): every request, generation
        # or not; labels bounded whatever the client sends.
        self.http_requests = Counter(
            "mili_http_requests_total",
            "Requests answered on the HTTP port, by route template (`unmatched`: no route for "
            "the path and method), method (`_OTHER`: not one of HTTP's) and status code sent "
            "(499: the client went away before one was; a stream that failed after its 200 "
            "went out: its error's status)",
            ["route", "method", "status"],
            registry=registry,
        )
        self.http_request_duration = Histogram(
            "mili_http_request_duration_seconds",
            "From a request's headers read to its response's last byte written (a stream's "
            "end), by route template; once per request",
            ["route"],
            buckets=HTTP_BUCKETS,
            registry=registry,
        )

    def watch(self, *, num_in_flight_requests: Read) -> None:
        """Gauges read from the servicer at scrape time (call once per registry)."""
        _callback_gauge(
            self.registry,
            "mili_frontend_in_flight_requests",
            "Generate and Complete requests admitted and not yet finished (tokenizing, "
            "waiting in the admission queue, prefilling or streaming)",
            num_in_flight_requests,
        )

    def watch_queue(self, *, num_requests: Read, num_tokens: Read) -> None:
        """The admission queue's depth, read at scrape time (call once per registry)."""
        _callback_gauge(
            self.registry,
            "mili_frontend_queued_requests",
            "Requests waiting in the admission queue for room on a decode (or prefill) instance",
            num_requests,
        )
        _callback_gauge(
            self.registry,
            "mili_frontend_queued_prompt_tokens",
            "Prompt tokens of the requests waiting in the admission queue",
            num_tokens,
        )

    def watch_instances(self, read: Callable[[], Iterable[tuple[str, str]]]) -> None:
        """mili_frontend_instances{kind, state}: `read()` gives one (kind, state) per instance
        the frontend knows, at scrape time (call once per registry)."""
        self.registry.register(_InstancesCollector(read))


class _InstancesCollector(Collector):
    KINDS = ("prefill", "decode")
    STATES = ("up", "down", "draining")

    def __init__(self, read: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "mili_frontend_instances",
            "Prefill and decode instances the frontend knows (fixed or discovered by DNS), by "
            "state: up (routed), down (not answering Info, or not checked yet), draining (gone "
            "from discovery, finishing its requests)",
            labels=["kind", "state"],
        )
        counts = dict.fromkeys(((k, s) for k in self.KINDS for s in self.STATES), 0)
        for kind, state in self._read():
            counts[(kind, state)] = counts.get((kind, state), 0) + 1
        for (kind, state), n in counts.items():
            family.add_metric([kind, state], n)
        yield family


class PrefillMetrics:
    """Steps, queue, KV block pool and KV sent of one prefill instance."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.step_seconds = Histogram(
            "mili_prefill_step_seconds",
            "Wall time of one prefill forward (all layers, KV handed off, first tokens sampled)",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "mili_prefill_batch_size",
            "Prompt chunks packed into one prefill forward",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "mili_prefill_batch_tokens",
            "Prompt tokens computed in one prefill forward",
            buckets=BATCH_TOKEN_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "mili_prefill_tokens_total", "Prompt tokens computed", registry=registry
        )
        self.kv_sent_bytes = Counter(
            "mili_prefill_kv_sent_bytes_total",
            "KV payload bytes of transfers decode acknowledged",
            registry=registry,
        )
        self.kv_transfer_seconds = Histogram(
            "mili_prefill_kv_transfer_seconds",
            "Per acknowledged transfer: first KV chunk written -> decode's acknowledgement",
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )

    def record_step(self, seconds: float, num_chunks: int, num_tokens: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(num_chunks)
        self.batch_tokens.observe(num_tokens)
        self.tokens.inc(num_tokens)

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        self.kv_sent_bytes.inc(num_bytes)
        self.kv_transfer_seconds.observe(seconds)

    def watch(
        self,
        *,
        num_queued_tokens: Read,
        num_queued_requests: Read,
        num_waiting_requests: Read,
        num_total_blocks: Read,
        num_free_blocks: Read,
    ) -> None:
        """Gauges read from the instance at scrape time (call once per registry)."""
        r = self.registry
        _callback_gauge(
            r,
            "mili_prefill_queued_tokens",
            "Prompt tokens accepted and not yet done (waiting, computing or transferring)",
            num_queued_tokens,
        )
        _callback_gauge(
            r,
            "mili_prefill_queued_requests",
            "Prompts accepted and not yet done (waiting, computing or transferring)",
            num_queued_requests,
        )
        _callback_gauge(
            r,
            "mili_prefill_waiting_requests",
            "Prompts waiting for their first forward (no KV blocks yet)",
            num_waiting_requests,
        )
        _pool_gauges(r, "prefill", num_total_blocks, num_free_blocks)


class DecodeMetrics:
    """Steps, batch, queue, KV block pool and KV received of one decode instance."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.step_seconds = Histogram(
            "mili_decode_step_seconds",
            "Wall time of one decode step over the running batch (forward and sampling)",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "mili_decode_batch_size",
            "Sequences in one decode step",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.kv_received_bytes = Counter(
            "mili_decode_kv_received_bytes_total",
            "KV payload bytes of committed transfers",
            registry=registry,
        )
        self.kv_transfer_seconds = Histogram(
            "mili_decode_kv_transfer_seconds",
            "Per committed transfer: header received -> every chunk landed and committed",
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.preemptions = Counter(
            "mili_decode_preemptions_total",
            "Running requests whose KV blocks were taken back for others (computed again on "
            "resuming)",
            registry=registry,
        )

    def record_step(self, seconds: float, batch_size: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch_size)

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        self.kv_received_bytes.inc(num_bytes)
        self.kv_transfer_seconds.observe(seconds)

    def watch(
        self,
        *,
        num_waiting_requests: Read,
        num_running_requests: Read,
        num_preempted_requests: Read,
        num_total_blocks: Read,
        num_free_blocks: Read,
    ) -> None:
        """Gauges read from the instance at scrape time (call once per registry)."""
        r = self.registry
        _callback_gauge(
            r,
            "mili_decode_waiting_requests",
            "Requests admitted (blocks reserved) whose KV has not all arrived yet",
            num_waiting_requests,
        )
        _callback_gauge(
            r,
            "mili_decode_running_requests",
            "Requests in the running batch",
            num_running_requests,
        )
        _callback_gauge(
            r,
            "mili_decode_preempted_requests",
            "Requests preempted when the KV pool ran dry, waiting for blocks to resume",
            num_preempted_requests,
        )
        _pool_gauges(r, "decode", num_total_blocks, num_free_blocks)


def _pool_gauges(
    registry: CollectorRegistry, service: str, num_total: Read, num_free: Read
) -> None:
    # Not `_total`: that suffix is a counter's (promtool rejects a gauge named so).
    _callback_gauge(
        registry, f"mili_{service}_kv_blocks_capacity", "KV blocks in the pool", num_total
    )
    _callback_gauge(registry, f"mili_{service}_kv_blocks_free", "KV blocks free", num_free)
    _callback_gauge(
        registry,
        f"mili_{service}_kv_blocks_used",
        "KV blocks held by requests (reserved, being written or in use)",
        lambda: num_total() - num_free(),
    )


class PrefixCacheCollector(Collector):
    """`mili_<service>_prefix_cache_*`: read from the cache at scrape time, so the prompt path
    moves no metric. The counters are the cache's own (monotonic since start)."""

    def __init__(
        self, registry: CollectorRegistry, service: str, read: Callable[[], PrefixCacheReading]
    ) -> None:
        self._prefix = f"mili_{service}_prefix_cache"
        self._read = read
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r = self._read()
        p = self._prefix
        yield GaugeMetricFamily(
            f"{p}_blocks", "Full KV blocks indexed by the prefix cache", r.cached_blocks
        )
        yield CounterMetricFamily(
            f"{p}_query_tokens", "Prompt tokens looked up in the prefix cache", r.query_tokens
        )
        yield CounterMetricFamily(
            f"{p}_hit_tokens", "Prompt tokens whose KV came from the prefix cache", r.hit_tokens
        )
        yield CounterMetricFamily(
            f"{p}_evicted_blocks", "Cached KV blocks evicted to make room", r.evicted_blocks
        )

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())  # names are fixed, but reading at registration would run `read` early
