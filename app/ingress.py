"""The HTTP ingress: OpenAI-style routes served by Starlette inside a Serve deployment."""

from __future__ import annotations

import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from configs.app import AppConfig


def openai_error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
    """An error body in the shape OpenAI's API and clients use."""
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": None}}, status_code=status
    )


@serve.ingress()
class Ingress:
    """Entry point for HTTP and Python handle calls."""

    def __init__(self, config: dict[str, Any], engines: DeploymentHandle, **pools: DeploymentHandle) -> None:
        self.config = AppConfig.model_validate(config)
        self.engines = engines
        self.pools = pools
        self.created = int(time.time())

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.served_model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kvrelay",
                    }
                ],
            }
        )
