"""The `localbatch` terminal app: chat tabs on one batched engine, live KV-budget and throughput
panels, SQLite persistence, an embedded OpenAI endpoint and a remote-backend client.

Textual is imported lazily so that `from app.ui import run_tui` stays cheap for the CLI."""

from app.lazy_exports import lazy_getattr

_EXPORTS = {
    "LocalbatchApp": "app.ui.app",
    "TuiOptions": "app.ui.app",
    "run_tui": "app.ui.app",
    "EngineFactory": "app.ui.loading",
    "ProgressFn": "app.engine.types.progress",
    "default_engine_factory": "app.ui.loading",
    "RemoteEngine": "app.clients.remote",
    "Config": "app.ui.user_config",
    "ConfigError": "app.ui.user_config",
    "load_config": "app.ui.user_config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
