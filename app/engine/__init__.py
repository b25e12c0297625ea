"""The continuous-batching engine: GGUF loading, paged KV, scheduling, sampling.

Exports load lazily so that importing a light submodule (errors, outputs) does not pull in torch.
"""

from app.lazy_exports import lazy_getattr

_EXPORTS = {
    "AsyncEngine": "app.engine.api.async_engine",
    "EngineClient": "app.engine.api.engine_client",
    "EngineConfig": "app.engine.types.engine_config",
    "EngineDeadError": "app.engine.types.errors",
    "EngineStats": "app.engine.types.outputs",
    "GGUFError": "app.engine.types.errors",
    "LLM": "app.engine.api.llm",
    "LLMEngine": "app.engine.core.llm_engine",
    "LocalbatchError": "app.engine.types.errors",
    "QueueFullError": "app.engine.types.errors",
    "RequestError": "app.engine.types.errors",
    "RequestOutput": "app.engine.types.outputs",
    "RequestStats": "app.engine.types.outputs",
    "SamplingParams": "app.engine.types.sampling_params",
    "SpeculativeConfig": "app.engine.types.speculative_config",
    "StreamDelta": "app.engine.types.outputs",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
