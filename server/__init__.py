"""pagedserve's HTTP front end: OpenAI protocol, streaming, auth, errors, Prometheus export, CLI."""

from pagedserve.server.app import create_app
from pagedserve.server.context import ServerSettings

__all__ = ["ServerSettings", "create_app"]
