"""API errors as the real API server spells them: an HTTP code plus a ``Status`` body.

Clients branch on ``reason`` and ``code`` (a Conflict retries, an AlreadyExists is fine, a 410 relists),
so the double must answer with the same shape, not a bare HTTP error.
"""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A failed request; ``status_body()`` is what goes on the wire."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def _details(kind: str, name: str) -> dict[str, Any]:
    return {"name": name, "kind": kind}


def not_found(plural: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{plural} "{name}" not found', _details(plural, name))


def already_exists(plural: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{plural} "{name}" already exists', _details(plural, name))


def conflict(plural: str, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": {why}',
                    _details(plural, name))


def stale(plural: str, name: str) -> ApiError:
    """The optimistic-concurrency failure: the caller's resourceVersion is not the current one."""
    return conflict(plural, name, "the object has been modified; please apply your changes to the latest "
                                  "version and try again")


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(plural: str, name: str, message: str) -> ApiError:
    return ApiError(422, "Invalid", f'{plural} "{name}" is invalid: {message}', _details(plural, name))


def invalid_fields(kind: str, group: str, name: str, field_errors: list[str]) -> ApiError:
    """A 422 as ``apierrors.NewInvalid`` builds it: ``<Kind>.<group> "<name>" is invalid: <aggregate>``
    (one error as is, several as ``[e1, e2]``), with one cause per field error."""
    aggregate = field_errors[0] if len(field_errors) == 1 else "[" + ", ".join(field_errors) + "]"
    qualified = f"{kind}.{group}" if group else kind
    details = {"name": name, "group": group, "kind": kind,
               "causes": [{"reason": "FieldValueInvalid", "message": e.split(": ", 1)[-1], "field": e.split(": ", 1)[0]}
                          for e in field_errors]}
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {aggregate}', details)


def expired(message: str) -> ApiError:
    """What a watch from a compacted resourceVersion gets (sent as an ERROR event, code 410)."""
    return ApiError(410, "Expired", message)


def too_large_resource_version(requested: int, current: int) -> ApiError:
    """What a watch from a resourceVersion the server has not reached gets after blocking 3 s: storage
    ``NewTooLargeResourceVersionError`` (a 504 ``apierrors.NewTimeoutError``, retry after 1 s, cause
    ``ResourceVersionTooLarge``), sent by cacher.go as an ERROR event. Clients relist (reflector.go
    ``isTooLargeResourceVersionError``)."""
    return ApiError(504, "Timeout", f"Timeout: Too large resource version: {requested}, current: {current}",
                    {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                     "retryAfterSeconds": 1})


def method_not_allowed(verb: str, path: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the requested "
                                             f"resource ({verb} {path})")


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: "
                                                 f"{content_type}")
