"""The engine core: sequences, the KV block manager, the scheduler, `LLMEngine.step()` and its
metrics. No tensors are touched here except through `runtime`."""
