"""Running one packed step on a device: the model runner, the decoder forward, attention dispatch,
sampling, device/dtype resolution and CUDA graphs."""
