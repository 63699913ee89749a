"""An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations


class ApiError(Exception):
    """A refusal of a request, with its HTTP status and the field at fault (param)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "timeout",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": status,
        }
    }
