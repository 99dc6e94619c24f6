"""GET /metrics: the server's counters in Prometheus text format (prometheus_client), one registry per server.

Requests are counted by endpoint and status where they are answered (access.py); generations, tokens, speculation
(drafted and accepted tokens, rounds, rollbacks by mode) and the seconds of each phase (prefill, decode, and inside
them draft, verify, rollback, sampling: src/snapspec/runtime/stats.py) when a job leaves the queue (record). The
queue's depth and the prefix cache's counters (hits, tokens reused, evictions, bytes: CacheCollector) are read when
the page is scraped. Labels take bounded values: an endpoint outside the
API is counted as "other", so a client cannot grow the page by inventing paths.
"""

from __future__ import annotations

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
PHASES = ("prefill", "decode", "draft", "verify", "rollback", "sampling")  # shown from the start, at 0
# request durations: from a refused request (milliseconds) to a long generation on a CPU (minutes)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def endpoint_label(path: str) -> str:
    return path if path in ENDPOINTS else "other"


class Metrics:
    """The server's Prometheus metrics. `queue` returns the worker's counts (waiting, running) when scraped;
    `draining` whether the server is shutting down; `cache` the server's PrefixCache (None: no prefix cache)."""

    def __init__(self, model_id: str, queue, draining, cache=None, scheduler=None):
        from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                                       disable_created_metrics)

        disable_created_metrics()  # no *_created series beside each counter: a shorter page (process-wide setting)
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, open fds (Linux)
        self.requests = Counter("snapspec_http_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.duration = Histogram("snapspec_http_request_duration_seconds", "Time from a request's arrival to the "
                                  "end of its response (a stream: its last event), by endpoint", ["endpoint"],
                                  buckets=BUCKETS, registry=r)
        self.generations = Counter("snapspec_generations", "Jobs that left the queue, by how they ended: a stop "
                                   "reason (eos, stop_string, length, context, cancelled, shutdown), 'skipped' (the "
                                   "client left while it waited) or 'failed'", ["model", "stop_reason"], registry=r)
        self.prompt_tokens = Counter("snapspec_prompt_tokens", "Prompt tokens of finished generations",
                                     ["model"], registry=r)
        self.prompt_reused = Counter("snapspec_prompt_tokens_reused", "Prompt tokens the contexts already held "
                                     "(not prefilled again)", ["model"], registry=r)
        self.completion_tokens = Counter("snapspec_completion_tokens", "Tokens generated", ["model"], registry=r)
        self.drafted = Counter("snapspec_draft_tokens", "Draft tokens proposed to the target", ["model"],
                               registry=r)
        self.accepted = Counter("snapspec_draft_tokens_accepted", "Draft tokens the target accepted", ["model"],
                                registry=r)
        self.rounds = Counter("snapspec_speculative_rounds", "Speculative rounds (draft, verify, roll back)",
                              ["model"], registry=r)
        self.rollbacks = Counter("snapspec_rollbacks", "State rollbacks, by side and mode (target:replay, "
                                 "drafter:ring, target:window, checkpoint, ...)", ["model", "mode"], registry=r)
        self.phase = Counter("snapspec_phase_seconds", "Seconds spent per phase: prefill and decode whole; draft, "
                             "verify, rollback, sampling inside them", ["model", "phase"], registry=r)
        waiting = Gauge("snapspec_queue_waiting", "Requests waiting in the queue", ["model"], registry=r)
        running = Gauge("snapspec_queue_running", "Requests being generated (at most --parallel)", ["model"],
                        registry=r)
        waiting.labels(model_id).set_function(lambda: queue()["waiting"])
        running.labels(model_id).set_function(lambda: queue()["running"])
        ratio = Gauge("snapspec_acceptance_ratio", "Accepted / drafted tokens since the server started",
                      ["model"], registry=r)
        ratio.labels(model_id).set_function(self._acceptance)
        Gauge("snapspec_draining", "1 while the server shuts down (new requests get 503)",
              registry=r).set_function(lambda: 1.0 if draining() else 0.0)
        if cache is not None:
            r.register(CacheCollector(model_id, cache))
        if scheduler is not None:
            r.register(SchedulerCollector(model_id, scheduler))
        self.model = model_id
        self._spec = (0, 0)  # drafted, accepted: the ratio's terms (replaced whole, read from any thread)
        for counter in (self.prompt_tokens, self.prompt_reused, self.completion_tokens, self.drafted, self.accepted,
                        self.rounds):
            counter.labels(model_id)
        for phase in PHASES:
            self.phase.labels(model_id, phase)

    def _acceptance(self) -> float:
        drafted, accepted = self._spec
        return accepted / drafted if drafted else 0.0

    def request(self, path: str, status: int, seconds: float) -> None:
        endpoint = endpoint_label(path)
        self.requests.labels(endpoint, str(status)).inc()
        self.duration.labels(endpoint).observe(seconds)

    def record(self, job, failed: bool) -> None:
        """A job has left the worker: count how it ended, its tokens and its generation's stats."""
        m, gen = self.model, job.gen
        if gen is None:
            self.generations.labels(m, "failed" if failed else "skipped").inc()
            return
        self.generations.labels(m, "failed" if failed else str(gen.stop_reason)).inc()
        s = gen.stats
        self.prompt_tokens.labels(m).inc(len(job.ids))
        self.prompt_reused.labels(m).inc(s.prompt_reused)
        self.completion_tokens.labels(m).inc(len(gen.tokens))
        self.drafted.labels(m).inc(s.drafted)
        self.accepted.labels(m).inc(s.accepted)
        self._spec = (self._spec[0] + s.drafted, self._spec[1] + s.accepted)
        self.rounds.labels(m).inc(s.rounds)
        for mode, n in s.rollbacks.items():
            self.rollbacks.labels(m, mode).inc(n)
        for phase, seconds in s.seconds.items():
            if seconds > 0:
                self.phase.labels(m, phase).inc(seconds)

    def page(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


class SchedulerCollector:
    """The scheduler's counters (runtime/scheduler.py: serve --parallel), read when the page is scraped: sequences
    running now, forwards run, how many ran several sequences, and their rows (rows per forward = rows / forwards;
    padding = verify rows of shorter drafts, rolled back); the same for the slots' MTP head forwards (head_*)."""

    def __init__(self, model_id: str, scheduler):
        self.model, self.scheduler = model_id, scheduler

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.scheduler.counters
        active = GaugeMetricFamily("snapspec_batch_active_sequences", "Sequences decoding now (joined the scheduler)",
                                   labels=["model"])
        active.add_metric([self.model], self.scheduler.live)
        yield active
        for name, doc, value in (
                ("forwards", "Target forwards the scheduler ran (batched or alone)", c.forwards),
                ("batched_forwards", "Forwards that ran several sequences' rows", c.batched_forwards),
                ("rows", "Token rows run, padding included", c.rows),
                ("padded_rows", "Padding rows (a shorter verify's, rolled back like a rejected draft)", c.padded_rows),
                ("sequence_calls", "Sequences' forwards served (the sum of each forward's batch size)", c.sequences),
                ("captured_forwards", "Forwards at fixed addresses: CUDA graphs of the batched forward replayed "
                 "(--cuda-graph)", c.captured_forwards),
                ("pooled_forwards", "Plain steps of the running requests as one forward over the slots' state pool "
                 "(--pooled)", c.pooled_forwards),
                ("ahead_forwards", ("Of those, steps queued before their requests asked, run on the device while "
                                    "the host handled the last step's tokens"), c.ahead_forwards),
                ("ahead_dropped_rows", "Rows of a step run ahead that their request did not take (it had stopped)",
                 c.ahead_dropped)):
            family = CounterMetricFamily(f"snapspec_batch_{name}", doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        h = self.scheduler.head_counters  # the slots' MTP head forwards (runners/batched_head.py)
        for name, doc, value in (
                ("head_forwards", "MTP head forwards the scheduler ran (batched or alone)", h.forwards),
                ("head_batched_forwards", "MTP head forwards that ran several sequences' rows", h.batched_forwards),
                ("head_rows", "MTP head rows run, padding included", h.rows),
                ("head_padded_rows", "MTP head padding rows (a shorter call's, truncated)", h.padded_rows)):
            family = CounterMetricFamily(f"snapspec_batch_{name}", doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        rows = GaugeMetricFamily("snapspec_batch_rows_per_forward", "Rows per forward since the server started",
                                 labels=["model"])
        rows.add_metric([self.model], c.rows / c.forwards if c.forwards else 0.0)
        yield rows


class CacheCollector:
    """The prefix cache's counters (runtime/prefix_cache.py), read from the cache when the page is scraped: its
    counters are the cache's own, shared by every slot."""

    def __init__(self, model_id: str, cache):
        self.model, self.cache = model_id, cache

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.cache.stats
        for name, doc, value in (
                ("hits", "Requests that loaded a prompt prefix from the prefix cache", s.hits),
                ("misses", "Requests that found no cached prefix longer than their slot's context held", s.misses),
                ("tokens_reused", "Prompt tokens loaded from the prefix cache instead of prefilled", s.tokens_reused),
                ("saves", "Snapshots saved", s.saves),
                ("evictions", "Snapshots evicted (least recently used first) to stay within --cache-ram",
                 s.evictions)):
            family = CounterMetricFamily(f"snapspec_prefix_cache_{name}", doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        for name, doc, value in (("bytes", "Bytes of snapshots held (state and token ids)", s.nbytes),
                                 ("budget_bytes", "The prefix cache's budget (--cache-ram)", s.budget),
                                 ("entries", "Snapshots held", s.entries)):
            family = GaugeMetricFamily(f"snapspec_prefix_cache_{name}", doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
