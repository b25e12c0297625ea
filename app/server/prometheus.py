"""/metrics in the Prometheus text exposition format (version 0.0.4), named like vLLM's `vllm:*`.

Gauges and token counters come from the engine's stats snapshot, so requests from the TUI's chat
tabs count too; latency histograms are observed by this server for the requests it serves.
Hand-written rather than `prometheus_client`: a dozen series do not justify a dependency with a
process-global registry (two apps in one process, as in tests, would collide)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from app.engine.types.outputs import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds (seconds), vLLM's choices for the same three histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Histogram:
    """Cumulative-bucket histogram; observed only from the server's event loop."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = _header(self.name, "histogram", self.help_text)
        cumulative = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += n
            le = format_labels({**labels, "le": format_value(bound)})
            lines.append(f"{self.name}_bucket{le} {cumulative}")
        lines.append(f"{self.name}_sum{format_labels(labels)} {format_value(self.sum)}")
        lines.append(f"{self.name}_count{format_labels(labels)} {self.count}")
        return lines


class ServerMetrics:
    """What the HTTP server measures itself: per-request latencies and finished-request counts."""

    def __init__(self) -> None:
        self.ttft = Histogram("localbatch:time_to_first_token_seconds",
                              "Time from request arrival to its first output token.", TTFT_BUCKETS)
        self.itl = Histogram("localbatch:inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram("localbatch:e2e_request_latency_seconds",
                             "Time from request arrival to its last output token.", E2E_BUCKETS)
        self.finished: dict[str, int] = {}

    def observe_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, stats: EngineStats, model_name: str) -> str:
        labels = {"model_name": model_name}
        lines = _engine_lines(stats, labels)
        name = "localbatch:request_success_total"
        lines += _header(name, "counter", "Finished requests served over HTTP, by finish reason.")
        for reason, count in sorted(self.finished.items()):
            lines.append(f"{name}{format_labels({**labels, 'finished_reason': reason})} {count}")
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render(labels)
        return "\n".join(lines) + "\n"


def kv_cache_usage(stats: EngineStats) -> float:
    """Blocks held by live requests over all blocks (cached-but-free prefix blocks do not count)."""
    return stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0


def _engine_lines(stats: EngineStats, labels: dict[str, str]) -> list[str]:
    series = [
        ("localbatch:num_requests_running", "gauge", "Requests in the running batch.", stats.num_running),
        ("localbatch:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting),
        ("localbatch:kv_cache_usage_perc", "gauge", "KV-cache usage: 1 means every block is held by a live request.",
         kv_cache_usage(stats)),
        ("localbatch:kv_cache_blocks_total", "gauge", "KV-cache blocks in the pool.", stats.num_blocks_total),
        ("localbatch:kv_cache_block_size", "gauge", "Tokens per KV-cache block.", stats.block_size),
        ("localbatch:kv_bytes_per_token", "gauge", "KV-cache bytes a token takes in every layer.",
         stats.kv_bytes_per_token),
        ("localbatch:kv_bytes_per_token_past_window", "gauge",
         "KV-cache bytes a token takes once sliding-window layers have dropped it (0: no such layers).",
         stats.kv_bytes_per_token_past_window),
        ("localbatch:kv_cache_tokens_fit", "gauge",
         "More tokens the free KV blocks hold at the running requests' cost per token.", stats.num_tokens_fit or 0),
        ("localbatch:prefix_cache_hit_rate", "gauge",
         "Prompt tokens served from the prefix cache over all prompt tokens.", stats.prefix_cache_hit_rate),
        ("localbatch:avg_prompt_throughput_toks_per_s", "gauge", "Recent prefill throughput.",
         stats.prefill_tokens_per_s),
        ("localbatch:avg_generation_throughput_toks_per_s", "gauge", "Recent decode throughput.",
         stats.decode_tokens_per_s),
        ("localbatch:prompt_tokens_total", "counter", "Prompt tokens processed.", stats.total_prompt_tokens),
        ("localbatch:generation_tokens_total", "counter", "Tokens generated.", stats.total_output_tokens),
        ("localbatch:num_preemptions_total", "counter", "Sequences preempted (recomputed later).",
         stats.num_preemptions),
        ("localbatch:num_steps_total", "counter", "Engine steps run.", stats.num_steps),
        ("localbatch:step_time_seconds_total", "counter", "Time spent in engine steps.", stats.total_step_time_s),
        ("localbatch:step_gap_seconds_total", "counter",
         "Time between a step that left requests unfinished and the next step: the host's work between "
         "steps (hand-offs to clients, the step loop).", stats.total_step_gap_s),
        ("localbatch:step_gaps_total", "counter", "Steps that followed a step with requests unfinished.",
         stats.num_step_gaps),
    ]
    if stats.speculative is not None:
        spec = stats.speculative
        series += [
            ("localbatch:spec_decode_num_draft_tokens_total", "counter", "Speculative tokens drafted.",
             spec.num_draft_tokens),
            ("localbatch:spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens the target kept.",
             spec.num_accepted_tokens),
        ]
    if stats.kv_disk is not None:
        disk = stats.kv_disk
        series += [
            ("localbatch:kv_disk_cache_enabled", "gauge", "1 while the KV disk tier is on.", int(disk.enabled)),
            ("localbatch:kv_disk_cache_bytes", "gauge", "Bytes of KV block files in the disk tier's directory.",
             disk.bytes_on_disk),
            ("localbatch:kv_disk_cache_budget_bytes", "gauge", "The disk tier's byte budget.", disk.budget_bytes),
            ("localbatch:kv_disk_cache_hits_total", "counter", "KV blocks read back from disk into the pool.",
             disk.num_blocks_read),
            ("localbatch:kv_disk_cache_restored_tokens_total", "counter",
             "Prompt tokens admitted from disk-read KV blocks instead of recomputed.", disk.num_tokens_restored),
            ("localbatch:kv_disk_cache_read_bytes_total", "counter", "Bytes of KV block files read.",
             disk.bytes_read),
            ("localbatch:kv_disk_cache_written_bytes_total", "counter", "Bytes of KV block files written.",
             disk.bytes_written),
            ("localbatch:kv_disk_cache_dropped_blocks_total", "counter",
             "KV blocks not written because the write queue was full.", disk.num_blocks_dropped),
            ("localbatch:kv_disk_cache_rejected_files_total", "counter",
             "KV block files removed unused: truncated, corrupt or another model's.", disk.num_files_rejected),
        ]
    lines: list[str] = []
    for name, kind, help_text, value in series:
        lines += _header(name, kind, help_text)
        lines.append(f"{name}{format_labels(labels)} {format_value(value)}")
    return lines
