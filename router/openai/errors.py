"""Errors of the OpenAI API as bodies, and the typed reads of request fields
that raise them (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import math
from typing import Any, Optional

# Integer ranges of the gRPC contract (int64 seed, int32 top_k and priority), enforced on HTTP too.
_INT_RANGES = {"seed": (-2**63, 2**64 - 1), "top_k": (-2**31, 2**31 - 1), "priority": (-2**31, 2**31 - 1)}


class APIError(Exception):
    """An error returned to the client as an OpenAI error body.

    Args:
        status: HTTP status code.
        message: What went wrong and what to change.
        param: The request field at fault, if any.
        type_: OpenAI error type.
        code: Machine-readable code, if any.
        headers: Extra response headers (``Retry-After`` of a 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        type_: str = "invalid_request_error",
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param)


def param_of(message: str) -> Optional[str]:
    """The field a ``SamplingParams``/tokenizer message starts with (``top_p must ...`` → ``top_p``)."""
    head = message.split(" ", 1)[0].split("[", 1)[0]
    return head if head.replace("_", "").replace(".", "").isalnum() else None


def number(body: dict, name: str, integer: bool) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise bad_request(f"{name} must be {kind}, got {value!r}", name)
    if integer and not isinstance(value, int):
        if not float(value).is_integer():
            raise bad_request(f"{name} must be an integer, got {value!r}", name)
        value = int(value)
    if not integer:
        value = float(value)
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value!r}", name)
    elif name in _INT_RANGES and not _INT_RANGES[name][0] <= value <= _INT_RANGES[name][1]:
        low, high = _INT_RANGES[name]
        raise bad_request(f"{name} must be in [{low}, {high}], got {value!r}", name)
    return value


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in value)
