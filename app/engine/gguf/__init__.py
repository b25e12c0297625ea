"""GGUF files and weights: the header reader, quant dequantization, the model config they describe,
the embedded default model and random-weight models of real shapes."""
