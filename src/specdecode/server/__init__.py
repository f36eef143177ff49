"""OpenAI-compatible HTTP server over the batched engine (`specdecode serve`)."""

from .app import create_app
from .service import Service

__all__ = ["Service", "create_app"]
