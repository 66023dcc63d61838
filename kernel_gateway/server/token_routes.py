"""``/v1/agents/{agent}/tokens``: the Jupyter API's per-agent tokens (handlers in ``jupyter_routes``)."""

from __future__ import annotations

from .jupyter_routes import token_routes


def routes() -> list[tuple[str, type]]:
    return token_routes()
