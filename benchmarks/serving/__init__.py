"""What serving costs the engine: `serve` against the engine alone, the per-token hand-off, a soak with faults."""
