"""Running one packed step on a device: the worker (loading the model, sizing the KV pool), the model
runner, the decoder forward, attention dispatch, sampling, device/dtype resolution and CUDA graphs."""
