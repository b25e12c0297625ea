"""The continuous-batching engine: GGUF loading, paged KV, scheduling, sampling.

Exports load lazily so that importing a light submodule (errors, outputs) does not pull in torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AsyncEngine": "app.engine.async_engine",
    "EngineClient": "app.engine.protocol",
    "EngineConfig": "app.engine.engine_config",
    "EngineDeadError": "app.engine.errors",
    "EngineStats": "app.engine.outputs",
    "GGUFError": "app.engine.errors",
    "LLM": "app.engine.llm",
    "LLMEngine": "app.engine.engine",
    "LocalbatchError": "app.engine.errors",
    "QueueFullError": "app.engine.errors",
    "RequestError": "app.engine.errors",
    "RequestOutput": "app.engine.outputs",
    "RequestStats": "app.engine.outputs",
    "SamplingParams": "app.engine.sampling_params",
    "StreamDelta": "app.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'app.engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
