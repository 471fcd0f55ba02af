"""Development routes, as vLLM's (``vllm/entrypoints/serve/dev``): they exist only in dev mode
(``serve.dev_mode``, ``bi-engine serve --dev-mode``, or vLLM's ``VLLM_SERVER_DEV_MODE=1``), since
they run code the client chooses; without it they answer 404, as any unknown path.

``POST /collective_rpc`` ``{"method": str, "args": [str, ...], "kwargs": {str: str}, "timeout":
float | null}`` calls ``method`` of every tensor-parallel rank's worker (``LLMEngine.collective_rpc``;
``bi_core/rl/collective_rpc.py``) and answers ``{"results": [...]}``, one per rank in rank order: None, an
object or a list as the method returned it, anything else its ``str()``. Arguments are strings only
(vLLM's rule: the method parses them). A body without ``method`` is a 400 ``Missing 'method' in
request body``; an unknown or private method a 400 naming it; a method that raised (naming the
rank) or outlasted ``timeout`` a 500."""

from __future__ import annotations

import os

from fastapi import FastAPI
from pydantic import BaseModel, Field

from bi_core.config import ServeConfig
from bi_core.serve.api_errors import ApiError
from bi_core.serve.messages import CollectiveRpc
from bi_core.serve.openai_protocol import STRICT

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode(config: ServeConfig) -> bool:
    """Whether the development routes exist: ``serve.dev_mode``, or ``VLLM_SERVER_DEV_MODE=1``."""
    return config.dev_mode or os.environ.get(DEV_MODE_ENV) == "1"


class CollectiveRpcBody(BaseModel):
    """vLLM's ``/collective_rpc`` body (``method`` is checked in the route, for vLLM's message)."""

    model_config = STRICT
    method: str | None = None
    args: list[str] = []
    kwargs: dict[str, str] = {}
    timeout: float | None = Field(None, gt=0)


REQUEST_MODELS = {"/collective_rpc": CollectiveRpcBody}


def install(app: FastAPI, server) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcBody):
        if body.method is None:
            raise ApiError(400, "Missing 'method' in request body", param="method")
        results = await server.call(CollectiveRpc, method=body.method, args=body.args, kwargs=body.kwargs,
                                    timeout=body.timeout)
        return {"results": results}
