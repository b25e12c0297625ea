"""What callers use: `LLM` (offline), `AsyncEngine` (a step thread bridged to asyncio) and the
`EngineClient` protocol they implement. Sampling params, settings, errors and outputs are in
`app.engine.types`."""
