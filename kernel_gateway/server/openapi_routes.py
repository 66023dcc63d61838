"""``GET /v1/openapi.json``: the API's own description (see :mod:`kernel_gateway.openapi`)."""

from __future__ import annotations

from .. import __version__, openapi
from .base import BaseHandler


class OpenAPIHandler(BaseHandler):
    def get(self) -> None:
        self.send_json(openapi.document(__version__))


def routes() -> list[tuple[str, type]]:
    return [(r"/v1/openapi\.json", OpenAPIHandler)]
