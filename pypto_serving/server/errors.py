"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause maps to a 4xx with a short message (no file paths, no stack
traces, never the request echoed back); anything else is a 500 that says only that.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pypto_serving.engine.async_llm import DrainingError
from pypto_serving.errors import PyptoError, RequestFailedError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1000
MAX_PARAM_BYTES = 200
"""Most bytes of an error's message and param as JSON, whatever the request held: an error
body stays under 2 KB."""
JSON_MEDIA_TYPE = "application/json"
UNAVAILABLE = "service_unavailable_error"
"""The error type of every 503: overloaded, shutting down, or the engine (or a worker) lost."""


class APIError(Exception):
    """An error answered as is: status code, message, OpenAI error type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
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


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` bytes of UTF-8 JSON (escapes included), lone surrogates
    (which UTF-8 cannot encode) replaced."""
    text = text.encode(errors="replace").decode()
    if len(text) * 6 <= limit:  # no character takes more than 6 bytes ("\u001f")
        return text
    size, end = 0, len(text)
    for i, ch in enumerate(text):
        size += len(json.dumps(ch, ensure_ascii=False).encode()) - 2
        if size > limit - 3:
            end = i
            break
    return text if end == len(text) else text[:end] + "..."


def quoted(text: str | None, limit: int = 60) -> str:
    """`text` as repr() shows it, cut short past `limit` characters (a client's name for
    something may be any size)."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "..." + shown[-1]


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    message = clip(message, MAX_MESSAGE_BYTES)
    param = None if param is None else clip(param, MAX_PARAM_BYTES)
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers
    )


UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "content": "a string or a list of text parts",
    "stop": "a string or a list of strings",
    "input": "a string or a list of input items (messages, function_call, function_call_output)",
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
    if not loc and kind == "missing":
        return "the request body is empty; send a JSON object", None, "invalid_json"
    if kind == "extra_forbidden":
        return f"unsupported parameter: {quoted(param)}", param, "unsupported_parameter"
    if kind == "missing":
        return f"missing required parameter: {param!r}", param, "missing_required_parameter"
    if not names and kind in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None, "invalid_type"
    if kind == "string_unicode":
        where = quoted(param) if param else "the request body"
        return f"{where} holds text that is not valid Unicode", param, "invalid_value"
    if param is None:
        return f"invalid request body: {err.get('msg', 'invalid')}", None, "invalid_value"
    return f"invalid value for {param!r}: {err.get('msg', 'invalid')}", param, "invalid_value"


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is one FastAPI parses as JSON (application/json or */*+json)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == JSON_MEDIA_TYPE or (
        media.startswith("application/") and media.endswith("+json")
    )


def unparsable(e: StarletteHTTPException) -> str | None:
    """Why FastAPI could not parse a JSON body (it answers 400 with the parser's exception as
    the cause), or None for any other HTTP error."""
    cause = e.__cause__
    if e.status_code != 400 or not isinstance(cause, ValueError | RecursionError):
        return None
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: it is nested too deeply"
    return "the request body is not valid JSON"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        if not is_json(request.headers.get("content-type")):
            message = f"the request body must be JSON, sent with Content-Type: {JSON_MEDIA_TYPE}"
            return error_response(APIError(415, message, code="unsupported_media_type"))
        errors = e.errors()
        message, param, code = _validation_message(errors[0] if errors else {})
        return error_response(APIError(400, message, param=param, code=code))

    @app.exception_handler(PyptoError)
    async def invalid_value(_: Request, e: PyptoError) -> JSONResponse:
        return error_response(APIError(400, str(e), param=e.param, code="invalid_value"))

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, e: RequestFailedError) -> JSONResponse:
        return error_response(APIError(503, str(e), UNAVAILABLE, code=e.code))

    @app.exception_handler(DrainingError)
    async def draining(_: Request, e: DrainingError) -> JSONResponse:
        return error_response(APIError(503, str(e), UNAVAILABLE, code="shutting_down"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        why = unparsable(e)
        if why is not None:
            return error_response(APIError(400, why, code="invalid_json"))
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind, headers=e.headers))

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in a request")
        return error_response(APIError(500, "internal server error", "internal_error"))
