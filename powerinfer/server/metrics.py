"""/metrics in Prometheus' text format, through prometheus_client: the scheduler's counters and
gauges read at each scrape, and latency histograms (time to first token, time between tokens,
time waiting for a slot) fed by the scheduler as it works."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from powerinfer.runtime.scheduler import Scheduler

# Seconds: from a few milliseconds (a decode step of a small model) to minutes (a long prefill on a big one).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """One app's metrics (its own registry, so several apps in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.scheduler: Scheduler | None = None

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(f"powerinfer_{name}_seconds", help_text, buckets=LATENCY_BUCKETS, registry=self.registry)

        self._first = histogram("time_to_first_token", "From a request's arrival to its first generated token.")
        self._inter = histogram("inter_token_latency", "Between consecutive tokens of one sequence.")
        self._queue = histogram("queue_wait", "From a request's arrival until it got its slots.")
        self.registry.register(self)

    # the scheduler's LatencyObserver
    def first_token(self, seconds: float) -> None:
        self._first.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._inter.observe(seconds)

    def queue_wait(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def collect(self):
        """The scheduler's counters and gauges, read at scrape time (prometheus_client's collector API)."""
        if self.scheduler is None:
            return
        stats, scheduler = self.scheduler.stats(), self.scheduler
        yield CounterMetricFamily("powerinfer_requests", "Generation requests received.", value=stats.requests)
        yield CounterMetricFamily("powerinfer_prompt_tokens", "Prompt tokens evaluated.", value=stats.prompt_tokens)
        yield CounterMetricFamily("powerinfer_tokens_generated", "Tokens generated.", value=stats.generated_tokens)
        for name, help_text, value in [
            ("tokens_per_second", "Generated tokens per second over the last 10 s.", scheduler.tokens_per_second()),
            ("queue_length", "Requests waiting for slots.", stats.queued),
            ("active_slots", "Slots generating now.", stats.active),
            ("slots", "Slots (--parallel).", scheduler.n_slots),
        ]:
            yield GaugeMetricFamily(f"powerinfer_{name}", help_text, value=value)

    def describe(self):
        return []  # collected fresh at each scrape

    def text(self) -> bytes:
        return generate_latest(self.registry)
