"""Reading a server's Prometheus `/metrics` text: the few series the panels show, under the
names localbatch, vLLM, SGLang and llama-server use."""

from __future__ import annotations

from types import MappingProxyType

# Metric name suffixes (after "localbatch:", "vllm:", "sglang:" or "llamacpp:") -> what they mean.
_METRIC_KEYS = MappingProxyType({
    "num_requests_running": "running",
    "num_running_reqs": "running",
    "requests_processing": "running",
    "num_requests_waiting": "waiting",
    "num_queue_reqs": "waiting",
    "requests_deferred": "waiting",
    "kv_cache_usage_perc": "kv_usage",
    "gpu_cache_usage_perc": "kv_usage",
    "token_usage": "kv_usage",
    "kv_cache_usage_ratio": "kv_usage",
    "kv_cache_blocks_total": "blocks_total",
    "kv_cache_block_size": "block_size",
    "kv_bytes_per_token": "kv_bytes_per_token",
    "kv_bytes_per_token_past_window": "kv_bytes_past_window",
    "kv_cache_tokens_fit": "tokens_fit",
    "prefix_cache_hit_rate": "prefix_hit_rate",
    "avg_prompt_throughput_toks_per_s": "prefill_rate",
    "avg_generation_throughput_toks_per_s": "decode_rate",
    "gen_throughput": "decode_rate",
    "prompt_tokens_total": "prompt_total",
    "generation_tokens_total": "generation_total",
    "tokens_predicted_total": "generation_total",
    "num_preemptions_total": "preemptions",
    "num_steps_total": "steps",
    "step_time_seconds_total": "step_time_total",
    "step_gap_seconds_total": "step_gap_total",
    "step_gaps_total": "step_gaps",
})
_PREFIXES = ("localbatch:", "vllm:", "sglang:", "llamacpp:")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> the values above (summed over label sets), plus block figures from
    vLLM's `cache_config_info{num_gpu_blocks=..., block_size=...}` labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, labels, value = _split_sample(line)
        if name is None:
            continue
        prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        suffix = name[len(prefix):]
        if suffix == "cache_config_info":
            for label, key in (("num_gpu_blocks", "blocks_total"), ("block_size", "block_size")):
                if labels.get(label, "").isdigit():
                    out[key] = float(labels[label])
            continue
        key = _METRIC_KEYS.get(suffix)
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


def _split_sample(line: str) -> tuple[str | None, dict[str, str], float]:
    labels: dict[str, str] = {}
    if "{" in line:
        name, _, rest = line.partition("{")
        body, _, tail = rest.rpartition("}")
        for part in _split_labels(body):
            key, _, val = part.partition("=")
            labels[key.strip()] = val.strip().strip('"')
    else:
        name, _, tail = line.partition(" ")
    fields = tail.split()
    try:
        return name.strip(), labels, float(fields[0])
    except (IndexError, ValueError):
        return None, {}, 0.0


def _split_labels(body: str) -> list[str]:
    parts, current, quoted = [], [], False
    for ch in body:
        if ch == '"' and (not current or current[-1] != "\\"):
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if current:
        parts.append("".join(current))
    return [p for p in parts if p.strip()]
