"""OpenAI-shaped errors: ``ApiError``, the ``param`` a validation error names (OpenAI's
``messages[0].content`` form), and the app's exception handlers. Routes whose SGLang counterparts
answer ``{"success": false, "message": ...}`` (weight updates) answer that too, alongside OpenAI's
``error`` object, so clients of either shape read the failure."""

from __future__ import annotations

import typing
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from bi_core.errors import RequestError
from bi_core.runtime.sequence import RequestOutput
from bi_core.serve import formats


class ApiError(Exception):
    """An error answer: status, OpenAI's error object, and a ``Retry-After`` when retrying helps."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, formats.error_body(message, type_, param, code)
        extra = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else {}
        self.headers = {**extra, **(headers or {})} or None


def output_failure(o: RequestOutput, shutting_down: bool) -> ApiError | None:
    """The error a choice ended with: the engine failed, or the server shut down before it finished.
    A request aborted by a control call (a pause in mode abort, an abort route, a weight update)
    is no error: its tokens so far come back with ``finish_reason: "abort"``, as vLLM and SGLang
    answer it (an RL trainer keeps partial rollouts)."""
    if o.finish_reason == "error":
        return ApiError(500, o.error or "the engine failed", "server_error")
    if o.finish_reason == "abort" and shutting_down:
        return ApiError(503, o.error or "the request was aborted", "service_unavailable")
    return None


def error_response(e: ApiError, success_style: bool = False) -> JSONResponse:
    body = {"success": False, "message": e.body["error"]["message"], **e.body} if success_style else e.body
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _model_in(annotation) -> type[BaseModel] | type[dict] | None:
    """The request model a field holds: itself, optional, or in a list; ``dict`` for a mapping (its
    keys come next in a location); None for anything else."""
    if typing.get_origin(annotation) is dict:
        return dict
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if not args:
        return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return _model_in(args[0]) if len(args) == 1 else None


def param_of(model: type[BaseModel] | None, loc: Sequence[str | int]) -> tuple[str | None, str | None]:
    """OpenAI's ``param`` for a pydantic error at ``loc`` (without "body"), and the union member
    it is about when the field takes several forms (pydantic puts the member's name in ``loc``,
    e.g. ``("prompt", "list[int]", 0)``; the param is then the field, ``prompt``)."""
    if model is None:
        return str(loc[0]), None
    param, current = "", model
    for x in loc:
        if isinstance(x, int):
            param += f"[{x}]"
        elif current is dict:  # a key of a mapping field
            param, current = f"{param}.{x}", None
        elif current is None:  # below a field that is no model: the name of a union member
            return param or None, x
        else:
            param += f".{x}" if param else x
            field = current.model_fields.get(x)
            if field is None:  # a field the model does not have (refused as extra)
                break
            current = _model_in(field.annotation)
    return param or None, None


def _loc(err: dict) -> list:
    """Where the error is, without FastAPI's source prefix (the body or the query string)."""
    loc = list(err.get("loc", ()))
    return loc[1:] if loc and loc[0] in ("body", "query") else loc


def validation_error(model: type[BaseModel] | None, errors: list[dict]) -> ApiError:
    err = errors[0] if errors else {}
    if err.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', 'parse error')}")
    loc = _loc(err)
    if not loc:  # the body as a whole: not an object (or not sent as JSON)
        return ApiError(400, "the request body must be a JSON object (Content-Type: application/json); "
                             f"{err.get('msg', 'invalid body')}")
    param, member = param_of(model, loc)
    if member is None:
        return ApiError(400, f"{param}: {err.get('msg', 'invalid value')}", param=param)
    forms = []  # every member's error names the member: list them all
    for e in errors:
        p, m = param_of(model, _loc(e))
        if p == param and m is not None and m not in forms:
            forms.append(m)
    return ApiError(400, f"{param}: invalid value; expected one of: {', '.join(forms)}", param=param)


def install_error_handlers(app: FastAPI, models: dict[str, type[BaseModel]],
                           success_style: frozenset[str] = frozenset()) -> None:
    """``models``: the request model of each route path (to name a validation error's param);
    ``success_style``: the paths whose errors also carry SGLang's ``success: false`` and ``message``."""

    def respond(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e, request.url.path in success_style)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return respond(request, e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return respond(request, validation_error(models.get(request.url.path), list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return respond(request, ApiError(e.status_code, str(e.detail), "invalid_request_error"))

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        return respond(request, ApiError(400, str(e)))
