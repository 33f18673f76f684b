"""The OpenAI error envelope and the one exception type every gateway layer raises.

Every failure a client can see -- malformed JSON, a bad parameter, an unknown model, an error
reported by a service further down the bus -- becomes an :class:`APIError`, rendered as
``{"error": {"message", "type", "param", "code"}}`` with ``code`` equal to the HTTP status.
Validation failures are 400, as vLLM answers (not FastAPI's 422): one status for "your request
is wrong", whether pydantic or ``SamplingParams.validate`` found it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pydantic import ValidationError
from starlette.responses import Response

from shared.protocol import ErrorInfo, ProtocolError

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# 429 and 503 mean "full or unreachable now, not wrong": the client is told when to try again
RETRY_AFTER_S = 1
RETRY_STATUSES = frozenset({429, 503})


class APIError(Exception):
    """A failure to report to the client: HTTP status, message, and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        self.headers = dict(headers or {})

    @classmethod
    def from_info(cls, info: ErrorInfo) -> APIError:
        status = info.code if 400 <= info.code <= 599 else 500
        return cls(status, info.message, info.param, info.type)

    def renamed(self, names: Mapping[str, str]) -> APIError:
        """This error naming the parameter by the field the client used (``names``: old -> new)."""
        param, message = rename_param(self.param, self.message, names)
        return self if param == self.param else APIError(self.status, message, param, self.type)

    @classmethod
    def from_protocol(cls, exc: ProtocolError) -> APIError:
        return cls(getattr(exc, "code", 400), exc.message, exc.param)

    @classmethod
    def from_validation(cls, exc: ValidationError) -> APIError:
        """The first pydantic error, with its location as ``param`` (``messages.0.role``)."""
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            return cls(400, f"malformed JSON body: {first['msg']}")
        loc = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
        where = f" ({loc})" if loc else ""
        return cls(400, f"invalid request{where}: {first['msg']}", loc or None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response_headers(self) -> dict[str, str]:
        """``headers``, with Retry-After on a 429 or 503 (a responder that writes its own status line
        should send these too)."""
        retry = {"retry-after": str(RETRY_AFTER_S)} if self.status in RETRY_STATUSES else {}
        return {**retry, **self.headers}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.response_headers())

    def sse_event(self) -> bytes:
        return f"data: {json.dumps(self.body())}\n\n".encode()


def rename_param(param: str | None, message: str, names: Mapping[str, str]) -> tuple[str | None, str]:
    """(param, message) with a parameter the services name (``structured_outputs.json``) replaced by
    the field the client set (``response_format.json_schema.schema``), also where the message opens with it."""
    if param not in names:
        return param, message
    new = names[param]
    return new, new + message[len(param):] if message.startswith(param + ":") else message


def _is_union_tag(part: object) -> bool:
    # pydantic puts the union member it tried into the location: ("prompt", "list[int]", 0)
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"})


def not_found_model(name: str | None) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "model")
