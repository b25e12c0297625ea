"""What callers use: `LLM` (offline), `AsyncEngine` (a step thread bridged to asyncio), the
`EngineClient` protocol they implement, sampling params, engine settings and errors."""
