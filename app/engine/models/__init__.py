from app.engine.models.decoder import DecoderLM

__all__ = ["DecoderLM"]
