"""Benchmarks: `localbatch bench` (`commands`: throughput, latency, serve, tui, compare, complete;
research, report, setup-llama-cpp) and the library the research benchmarks under benchmarks/
share: workloads (`datasets`), percentiles and the step split (`stats`), servers and `/metrics`
(`server`), a streaming HTTP client (`stream`), A/B runs seconds apart with the engine alone in a
worker process (`paired`, `worker`), results as JSON with the commit, CPU and flags (`results`)
and as Markdown tables (`report`), the research registry (`research`) and the pinned llama.cpp
the comparisons run against (`llama_cpp`).

Nothing here imports the engine (torch) at import time: the command line's parser stays cheap;
nothing here imports the command line (`app.cli`), which hands in its engine options instead."""
