"""API errors as `meta/v1 Status` bodies.

Clients branch on the HTTP code and on `reason` (kopf treats 409 as "retry with a fresh
object", 410 as "relist", 422 as a permanent error), so the emulator reports the same codes
and reasons as kube-apiserver (`k8s.io/apimachinery/pkg/api/errors`).
"""

from __future__ import annotations

from typing import Any

from vllm_localcluster.emulator.schema import ResourceType


class ApiError(Exception):
    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": rt.plural}
    if rt.group:
        details["group"] = rt.group
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.describe()} "{name}" not found', _details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rt.describe()} "{name}" already exists', _details(rt, name)
    )


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or (
        "the object has been modified; please apply your changes to the latest version "
        "and try again"
    )
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.describe()} "{name}": {why}',
        _details(rt, name),
    )


def invalid(rt: ResourceType, name: str, message: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{rt.kind}.{rt.group or "core"} "{name}" is invalid: {message}',
        _details(rt, name),
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def forbidden(rt: ResourceType, name: str, message: str) -> ApiError:
    return ApiError(
        403, "Forbidden", f'{rt.describe()} "{name}" is forbidden: {message}', _details(rt, name)
    )
