"""OpenAI-compatible HTTP endpoint over an `EngineClient` (FastAPI on uvicorn, in the caller's loop)."""

from app.server.factory import CorsPolicy, create_app
from app.server.serve import ApiServer, ServeError, check_exposure, cors_policy, serve

__all__ = ["ApiServer", "CorsPolicy", "ServeError", "check_exposure", "cors_policy", "create_app", "serve"]
