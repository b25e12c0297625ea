"""The engine's shared types, the bottom layer every other imports: errors, configs, sampling
parameters, prompts, outputs and stats, timing records, and the one reader of /proc/cpuinfo
(`cpu_info`). Torch-free."""
