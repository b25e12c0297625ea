"""OpenAI-compatible HTTP endpoint over an `EngineClient` (FastAPI on uvicorn, in the caller's loop)."""

from app.server.factory import create_app
from app.server.serve import ApiServer, ServeError, check_exposure, serve

__all__ = ["ApiServer", "ServeError", "check_exposure", "create_app", "serve"]
