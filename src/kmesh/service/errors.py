"""The service's typed errors and their wire codes.

The server raises these; an error reply carries `code` + message; the client raises the same class again
(ERRORS_BY_CODE), so a caller catches `NotOwnerError`, not a string. `fatal` errors end the connection after
the reply (the byte stream can no longer be trusted); every other error leaves the connection usable.
"""
from __future__ import annotations

from kmesh.errors import KMeshError


class ServiceError(KMeshError):
    """Base of errors the service reports to a client."""

    code = "service"
    fatal = False


# -- framing and decoding (the bytes) ---------------------------------------------------------------
class FrameError(ServiceError):
    """The frame header is not a KMesh frame (bad magic): the stream cannot be resynchronised."""

    code, fatal = "frame", True


class FrameTooLargeError(FrameError):
    """The header declares more payload bytes (or fds) than a frame may carry."""

    code, fatal = "frame_too_large", True


class TruncatedFrameError(FrameError):
    """The peer stopped sending in the middle of a frame."""

    code, fatal = "truncated", True


class UnsupportedVersionError(ServiceError):
    """The frame's protocol version is not one this service speaks (the payload is skipped)."""

    code = "version"


class DecodeError(ServiceError):
    """The payload is not one msgpack map with string keys (bad msgpack, trailing bytes, ext types, depth)."""

    code = "decode"


class SchemaError(ServiceError):
    """A field is missing, unknown, of the wrong type or out of range; the message names it."""

    code = "schema"


class UnknownOpError(SchemaError):
    code = "unknown_op"


# -- session and identity ----------------------------------------------------------------------------
class SequenceError(ServiceError):
    """A message arrived out of order (work before hello, a second hello, ...)."""

    code = "sequence"


class AuthError(ServiceError):
    """Wrong token for this connection, or a peer (uid) the service does not serve."""

    code = "auth"


class NotAuthorizedError(AuthError):
    """An admin operation (shutdown, status of all clients, evict) without the service's admin token: ordinary
    clients, even of the service's own uid, may not do these."""

    code = "not_authorized"


class ClientLostError(ServiceError):
    """This client was declared lost (heartbeat, taken over by an admin): reconnect and register anew."""

    code = "client_lost"


class InstanceInUseError(ServiceError):
    """hello claimed the instance number of a client that is still live (its process runs, its heartbeat is
    on time). Wait for it to go, pick another instance (or none: anonymous), or take over with the admin
    capability (hello takeover=true + admin), which closes the old client's registrations."""

    code = "instance_in_use"


# -- registrations ------------------------------------------------------------------------------------
class NotOwnerError(ServiceError):
    """The request names a registration that belongs to another client."""

    code = "not_owner"


class UnknownRegistrationError(ServiceError):
    code = "unknown_registration"


class StaleGenerationError(ServiceError):
    """The generation does not match (an older allocation), or a new registration does not advance it."""

    code = "stale_generation"


class RegistrationClosedError(ServiceError):
    """The registration is closing/drained/released: it accepts no new work."""

    code = "registration_closed"


class RegistrationStateError(ServiceError):
    """The registration is in a state where this operation makes no sense (e.g. work before activate)."""

    code = "registration_state"


class LayoutMismatchError(ServiceError):
    """The request's layout does not match the registered layout (or the object's)."""

    code = "layout_mismatch"


class HandleError(ServiceError):
    """The memory handle is unusable: wrong fd count, not a memfd/shm file, too small, cannot be mapped."""

    code = "handle"


class RangeError(ServiceError):
    """Offset/size outside the registered memory or not aligned to the layout's element size."""

    code = "range"


class DestinationBusyError(ServiceError):
    """The byte range is reserved by an accepted copy that has not drained yet."""

    code = "busy"


class UnknownRequestError(ServiceError):
    code = "unknown_request"


# -- store --------------------------------------------------------------------------------------------
class ObjectMissingError(ServiceError):
    code = "object_missing"


class DiskReadError(ObjectMissingError):
    """The original's RAM copy was gone and reading it back from its object file failed (missing, corrupt,
    replaced, I/O error): nothing was installed or copied; every load joined to that read gets this reply."""

    code = "disk_read"


class RemoteReadError(ObjectMissingError):
    """This host does not hold the original and fetching it from the remote tier failed (store unreachable,
    the image rejected by a check): nothing was installed or copied; every load joined to that fetch gets this
    reply. (An object the store does not hold either is plain ObjectMissingError.)"""

    code = "remote_read"


class ObjectExistsError(ServiceError):
    """Originals are immutable: a key is stored once (evict it first)."""

    code = "object_exists"


class CapacityError(ServiceError):
    """A limit was reached (store bytes, registrations, requests)."""

    code = "capacity"


# -- service ------------------------------------------------------------------------------------------
class ShuttingDownError(ServiceError):
    code = "shutting_down"


class ReplyTooLargeError(ServiceError):
    """The reply to a valid request would not fit in one frame (protocol.MAX_PAYLOAD). Replies are bounded by
    design (status is a summary, lists come in pages), so this is a service bug; it is reported, not fatal: the
    connection and the client's registrations stay."""

    code = "reply_too_large"


class InternalError(ServiceError):
    """A bug in the service; the request was refused and the registry left as it was."""

    code = "internal"


# -- client side only ---------------------------------------------------------------------------------
class ServiceUnavailableError(ServiceError):
    """No service answers at the socket (not started, or gone)."""

    code = "unavailable"


class ConnectionLostError(ServiceError):
    """The service closed the connection."""

    code = "connection_lost"


class WaitTimeoutError(ServiceError):
    """A request did not finish within the wait timeout (it is still running)."""

    code = "wait_timeout"


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[ServiceError]] = {c.code: c for c in [ServiceError, *_all_subclasses(ServiceError)]}
assert len(ERRORS_BY_CODE) == 1 + len(_all_subclasses(ServiceError)), "duplicate error code"


def error_from_reply(code: object, message: object) -> ServiceError:
    """The exception a client raises for an error reply (unknown codes become ServiceError, never lost)."""
    cls = ERRORS_BY_CODE.get(code) if isinstance(code, str) else None
    if cls is None:
        return ServiceError(f"[{code!r}] {message}")
    return cls(str(message))
