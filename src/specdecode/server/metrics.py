"""Prometheus metrics of the server (one registry per service, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..batch import StepReport

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdecode_requests", "Requests answered, by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "specdecode_prompt_tokens_cached", "Prompt tokens served from the prefix cache (not read again)", registry=r)
        self.prefix_entries = Gauge("specdecode_prefix_cache_entries", "Finished prompts whose K/V the prefix cache holds",
                                    registry=r)
        self.prefix_tokens = Gauge("specdecode_prefix_cache_tokens", "Tokens the prefix cache's entries hold", registry=r)
        self.prefix_evictions = Gauge(
            "specdecode_prefix_cache_evictions", "Entries evicted since start, least recently used first, past the cache's "
            "bound in entries or tokens", registry=r)
        self.prefix_restore_failures = Gauge(
            "specdecode_prefix_cache_restore_failures", "Prompts whose cached prefix found no free KV cells to go back "
            "into (llama.cpp): read whole", registry=r)
        self.generation_tokens = Counter("specdecode_generation_tokens", "Tokens generated", registry=r)
        self.queue_length = Gauge("specdecode_queue_length", "Requests waiting to join the batch", registry=r)
        self.batch_size = Gauge("specdecode_batch_size", "Rows in the last verify pass", registry=r)
        self.batch_rows = Histogram("specdecode_batch_rows", "Rows per verify pass", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.finished = Counter("specdecode_finished_requests", "Requests finished, by reason (stop, length, cancelled, error)",
                                ["reason"], registry=r)
        self.running = Gauge("specdecode_running_requests", "Requests admitted and not finished", registry=r)
        self.draft_tokens = Counter("specdecode_draft_tokens", "Tokens proposed by the drafter", registry=r)
        self.accepted_tokens = Counter("specdecode_accepted_tokens", "Drafted tokens the target accepted", registry=r)
        self.draft_by_source = Counter(
            "specdecode_draft_tokens_by_source",
            "Drafted tokens by source (suffix, suffix/chain: a long copy, answers: the tree over answers, "
            "earlier/chain: another request's copy, ngram, a model)", ["source"], registry=r)
        self.accepted_by_source = Counter(
            "specdecode_accepted_tokens_by_source", "Accepted tokens by the source that drafted them", ["source"], registry=r)
        self.draft_by_position = Counter(
            "specdecode_draft_tokens_by_position", "Drafted tokens by position in the draft (1 = first)", ["position"], registry=r)
        self.accepted_by_position = Counter(
            "specdecode_accepted_tokens_by_position", "Accepted tokens by position in the draft (1 = first)", ["position"], registry=r)
        self.steps = Counter(
            "specdecode_steps", "Engine steps; speculation=off: no row drafted (plain decoding, e.g. chosen by load-aware control); "
            "lookup: model drafting did not pay for the batch, rows drafted by n-gram lookup only; on: drafting as usual",
            ["speculation"], registry=r)
        self.batch_steps = Counter(
            "specdecode_batch_steps", "Engine steps by rows in the pass and speculation (off, lookup, on)", ["rows", "speculation"], registry=r)
        self.speculation_on = Gauge("specdecode_speculation_on", "1 if the last step drafted, else 0", registry=r)
        self.draft_seconds = Histogram("specdecode_draft_seconds", "Drafting time per step (all rows)", buckets=STEP_BUCKETS, registry=r)
        self.verify_seconds = Histogram("specdecode_verify_seconds", "Target verify pass time per step", buckets=STEP_BUCKETS, registry=r)
        self.admit_seconds = Histogram("specdecode_admit_seconds", "Prefill of the requests that joined, per step that admitted any", buckets=STEP_BUCKETS, registry=r)
        self.step_seconds = Histogram("specdecode_step_seconds", "Whole engine step, by rows in the pass (compare servers step by step)",
                                      ["rows"], buckets=STEP_BUCKETS, registry=r)
        self.between_steps = Counter(
            "specdecode_scheduler_between_steps_seconds", "Time the scheduler thread spent between engine steps (handing "
            "tokens to their requests, detokenizing, these metrics): serving's own cost on the steps' critical path; against "
            "specdecode_step_seconds_sum, what serving adds to the engine", registry=r)
        self.ttft = Histogram("specdecode_time_to_first_token_seconds", "Submission to first token", buckets=REQUEST_BUCKETS, registry=r)
        self.latency = Histogram("specdecode_request_seconds", "Submission to last token", buckets=REQUEST_BUCKETS, registry=r)
        self.calibrated_pass = Gauge(
            "specdecode_calibrated_pass_seconds", "A target pass scoring `width` positions, as timed at load (the controller's "
            "first prices; a server that drafts differently from another may have read different ones)", ["width"], registry=r)

    def record_calibration(self, calibration: dict | None) -> None:
        for width, seconds in (calibration or {}).get("verify_s", {}).items():
            self.calibrated_pass.labels(str(width)).set(seconds)

    def record_prefix_cache(self, cache) -> None:
        """What a backend's PrefixCache holds and has evicted (None: no prefix cache)."""
        if cache is None:
            return
        self.prefix_entries.set(len(cache.entries))
        self.prefix_tokens.set(cache.tokens)
        self.prefix_evictions.set(cache.stats.evictions)
        self.prefix_restore_failures.set(cache.stats.restore_failures)

    def record_step(self, report: StepReport, running: int, waiting: int) -> None:
        self.queue_length.set(waiting)
        self.running.set(running)
        if report.rows:
            self.batch_size.set(report.rows)
            self.batch_rows.observe(report.rows)
            mode = "off" if not report.speculative else "lookup" if report.lookup_only else "on"
            self.steps.labels(mode).inc()
            self.batch_steps.labels(str(report.rows), mode).inc()
            self.speculation_on.set(1 if report.speculative else 0)
            self.draft_seconds.observe(report.draft_s)
            self.verify_seconds.observe(report.verify_s)
            self.step_seconds.labels(str(report.rows)).observe(report.step_s)
        if report.cached_tokens:
            self.cached_prompt_tokens.inc(report.cached_tokens)
        if report.admitted:
            self.admit_seconds.observe(report.admit_s)
        self.draft_tokens.inc(report.drafted)
        self.accepted_tokens.inc(report.accepted)
        for source, (drafted, accepted) in report.by_source.items():
            self.draft_by_source.labels(source).inc(drafted)
            self.accepted_by_source.labels(source).inc(accepted)
        for i, n in enumerate(report.drafted_per_position):
            self.draft_by_position.labels(str(i + 1)).inc(n)
        for i, n in enumerate(report.accepted_per_position):
            self.accepted_by_position.labels(str(i + 1)).inc(n)
        for _, chunk in report.events:
            self.generation_tokens.inc(len(chunk))
        for seq in report.finished:
            self.finished.labels(seq.result.finish_reason or "unknown").inc()
            if seq.result.token_ids:
                self.ttft.observe(seq.stats.time_to_first_token_s)
                self.latency.observe(seq.stats.total_time_s)
