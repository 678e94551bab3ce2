"""The server's exception hierarchy; app.py maps each to an OpenAI-style JSON error with its HTTP status.

Body shape (what the openai SDK parses): {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error a client should see. Subclasses fix the HTTP status and the OpenAI error type."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status_code,
            }
        }


class BadRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class Unauthorized(APIError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(APIError):
    status_code = 403
    error_type = "permission_error"


class NotFound(APIError):
    status_code = 404
    error_type = "not_found_error"


class Overloaded(APIError):
    """429: the traffic cluster's waiting queue is full. Retry-After says when to come back."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int, code: str = "queue_full") -> None:
        super().__init__(message, code=code)
        self.retry_after = max(1, int(retry_after))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class NotReady(APIError):
    """503: the model is loading, the engine loop died, or the server is draining."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message, code="not_ready")
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class EngineError(APIError):
    """500: the engine failed this request (e.g. the forward pass raised)."""

    status_code = 500
    error_type = "server_error"
