"""Errors of the page table: each is a caller's mistake, and each maps to one gRPC status.

A full pool or an exhausted quota is not an error but an answer (``allocator.Refusal``). These
exceptions are raised before any state changes, so a rejected call leaves the page table as it was.
"""

from __future__ import annotations


class BlockServiceError(Exception):
    """Base of the errors a request can cause; ``str(err)`` is a message a person can act on.
    ``code`` names the gRPC status the service answers with."""

    code = "INVALID_ARGUMENT"


class InvalidArgument(BlockServiceError, ValueError):
    """Malformed field: bad count, hash of the wrong length, empty id, duplicate in one batch."""

    code = "INVALID_ARGUMENT"


class NotFound(BlockServiceError, LookupError):
    """Unknown node or sequence."""

    code = "NOT_FOUND"


class AlreadyExists(BlockServiceError):
    """A live sequence id used again, or a node registered twice with a different shape."""

    code = "ALREADY_EXISTS"


class PermissionDenied(BlockServiceError, PermissionError):
    """A tenant touching another tenant's sequence."""

    code = "PERMISSION_DENIED"


class FailedPrecondition(BlockServiceError):
    """A valid request that the current state forbids (e.g. re-committing a block with a new hash)."""

    code = "FAILED_PRECONDITION"


class Unavailable(BlockServiceError):
    """The service cannot make changes durable (its log failed); nothing was changed."""

    code = "UNAVAILABLE"


class ResourceExhausted(BlockServiceError):
    """A budget that a whole call would pass (a tenant's pins on a node); nothing was changed."""

    code = "RESOURCE_EXHAUSTED"


ERRORS_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, NotFound, AlreadyExists, PermissionDenied, FailedPrecondition, Unavailable, ResourceExhausted,
)}
