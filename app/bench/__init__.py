"""Benchmarks: `localbatch bench` (`commands`: throughput, latency, serve, tui, compare, complete)
and the library the research scripts under benchmarks/ share: workloads (`datasets`), percentiles
and the step split (`stats`), servers and `/metrics` (`server`), a streaming HTTP client
(`stream`), A/B runs seconds apart with the engine alone in a worker process (`paired`, `worker`),
and results as JSON with the commit, CPU and flags (`results`).

Nothing here imports the engine (torch) at import time: the command line's parser stays cheap."""
