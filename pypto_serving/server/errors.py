"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause maps to a 4xx with a short message (no file paths, no stack
traces, never the request echoed back); anything else is a 500 that says only that.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pypto_serving.engine.async_llm import EngineDeadError
from pypto_serving.errors import PyptoError

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 500


class APIError(Exception):
    """An error answered as is: status code, message, OpenAI error type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers
    )


UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "content": "a string or a list of text parts",
    "stop": "a string or a list of strings",
}
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_message(err: dict[str, Any]) -> tuple[str, str | None, str]:
    """(message, param, code) for pydantic's first complaint about a request body."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    # a union's members appear in the location ("str", "list[int]", ...); keep field names
    names = []
    for x in loc:
        if x.lower() in TYPE_TAGS or "[" in x or "-" in x or x[:1].isupper():
            break
        names.append(x)
    param = ".".join(names) or None
    if len(names) < len(loc) and names and names[-1] in UNION_FIELDS:
        return f"{param!r} must be {UNION_FIELDS[names[-1]]}", param, "invalid_value"
    if kind == "json_invalid":
        return "the request body is not valid JSON", None, "invalid_json"
    if kind == "extra_forbidden":
        return f"unsupported parameter: {param!r}", param, "unsupported_parameter"
    if kind == "missing":
        return f"missing required parameter: {param!r}", param, "missing_required_parameter"
    if not names and kind in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None, "invalid_type"
    return f"invalid value for {param!r}: {err.get('msg', 'invalid')}", param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        message, param, code = _validation_message(errors[0] if errors else {})
        return error_response(APIError(400, message, param=param, code=code))

    @app.exception_handler(PyptoError)
    async def invalid_value(_: Request, e: PyptoError) -> JSONResponse:
        return error_response(APIError(400, str(e), param=e.param, code="invalid_value"))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, str(e), "service_unavailable", code="engine_dead"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind, headers=e.headers))

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in a request")
        return error_response(APIError(500, "internal server error", "internal_error"))
