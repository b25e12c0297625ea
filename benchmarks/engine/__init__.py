"""The engine's policies: the thread tuner under busy neighbours, speculative decoding, the KV window cap."""
