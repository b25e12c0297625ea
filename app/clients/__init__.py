"""Engine clients that talk to an engine elsewhere (an OpenAI-compatible HTTP server)."""
