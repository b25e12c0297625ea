"""The engine's shared types, the bottom layer every other imports: errors, configs, sampling
parameters, prompts, outputs and stats, timing records. Torch-free."""
