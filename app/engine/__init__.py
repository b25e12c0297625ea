"""The continuous-batching engine: GGUF loading, paged KV, scheduling, sampling.

Exports load lazily so that importing a light submodule (errors, outputs) does not pull in torch.
"""

from app.lazy_exports import lazy_getattr

_EXPORTS = {
    "AsyncEngine": "app.engine.api.async_engine",
    "EngineClient": "app.engine.api.engine_client",
    "EngineConfig": "app.engine.api.engine_config",
    "EngineDeadError": "app.engine.api.errors",
    "EngineStats": "app.engine.core.outputs",
    "GGUFError": "app.engine.api.errors",
    "LLM": "app.engine.api.llm",
    "LLMEngine": "app.engine.core.llm_engine",
    "LocalbatchError": "app.engine.api.errors",
    "QueueFullError": "app.engine.api.errors",
    "RequestError": "app.engine.api.errors",
    "RequestOutput": "app.engine.core.outputs",
    "RequestStats": "app.engine.core.outputs",
    "SamplingParams": "app.engine.api.sampling_params",
    "StreamDelta": "app.engine.core.outputs",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
