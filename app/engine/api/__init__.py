"""What callers use: `LLM` (offline), `AsyncEngine` (a step thread bridged to asyncio), the
`EngineClient` protocol they implement, and `process_settings`, the one owner of what an engine
changes for the whole process (the GIL switch interval, objects frozen out of the collector).
Sampling params, settings, errors and outputs are in `app.engine.types`."""
