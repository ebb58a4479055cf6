"""Domain errors -> gRPC status codes, in one interceptor per server."""

from __future__ import annotations

import asyncio
import inspect
import logging

import grpc
import redis.exceptions
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from splitserve.engine.errors import CapacityError, InvalidRequestError, KVImportError
from splitserve.handoff.arena import BadHandle

log = logging.getLogger(__name__)
# google.rpc.Status in a failed call's trailers (what grpcio-status reads), and ErrorInfo's domain
STATUS_DETAILS_KEY = "grpc-status-details-bin"
ERROR_DOMAIN = "splitserve.v1"
# RetryInfo of an UNAVAILABLE without a hint of its own: a router or worker back, a Redis answering
UNAVAILABLE_RETRY_MS = 1000
# Redis down, unreachable or not answering in time: the service cannot admit or look up
# requests now, and a retry may succeed (UNAVAILABLE, which gRPC retry policies retry).
REDIS_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# A status message's most bytes as it travels in the trailers (grpc-message, percent-encoded): gRPC
# refuses trailers past 16 KiB (and may past 8 KiB), and the client then gets RESOURCE_EXHAUSTED
# "Stream removed" instead of the status. The message travels twice (grpc-message, and in the
# google.rpc.Status of grpc-status-details-bin, base64: 4/3 of its UTF-8), so 2 KiB of it keeps
# the trailers near 5 KiB. A longer message (one that quotes a long input) is cut.
MAX_DETAILS_BYTES = 2048
# A BadRequest field violation's description at most: the whole text is the status's message
MAX_VIOLATION_CHARS = 200


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, metadata: tuple = (), reason: str = ""):
        super().__init__(message)
        self.metadata = metadata
        self.reason = reason  # ErrorInfo.reason: a stable name for why (default: the status's name)


class Refused(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class Invalid(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status an exception leaves an RPC with (no logging: for spans and metrics)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # GeneratorExit: a stream's client went
        return grpc.StatusCode.CANCELLED  # away while its handler was writing, not awaiting
    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, (InvalidRequestError, KVImportError, BadHandle)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, REDIS_UNREACHABLE):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code()
    return grpc.StatusCode.INTERNAL


def status_code(value: int) -> grpc.StatusCode | None:
    """The status code with this number (as it travels in a proto), or None."""
    return next((c for c in grpc.StatusCode if c.value[0] == value), None)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    """Status, message and trailing metadata for an exception; unexpected ones are logged."""
    code = code_of(exc)
    if isinstance(exc, ServiceError):
        return code, str(exc), exc.metadata
    if isinstance(exc, REDIS_UNREACHABLE):
        log.warning("Redis unreachable: %s", exc)
        return code, f"the queue state store (Redis) is unreachable, retry shortly: {exc}", ()
    if isinstance(exc, asyncio.TimeoutError):
        return code, "deadline exceeded", ()
    if isinstance(exc, grpc.aio.AioRpcError):  # an upstream call failed: pass its status on
        return code, exc.details() or "", ()
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=exc)
        return code, f"internal error: {type(exc).__name__}: {exc}", ()
    return code, str(exc), ()


def fit_details(message: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """message, cut to at most limit bytes as gRPC sends it (each byte of UTF-8 outside printable
    ASCII, and '%', takes three), saying how much was cut."""
    size, keep = 0, None
    for i, ch in enumerate(message):
        size += sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in ch.encode("utf-8", "surrogatepass"))
        if keep is None and size > limit - 40:  # room for the note (ASCII, under 40 bytes)
            keep = i
        if size > limit:
            return f"{message[:keep]}... ({len(message) - keep} more characters)"
    return message


def reason_of(exc: BaseException, code: grpc.StatusCode) -> str:
    """ErrorInfo.reason: a stable UPPER_SNAKE name of why the call failed."""
    if getattr(exc, "reason", ""):
        return exc.reason
    if isinstance(exc, REDIS_UNREACHABLE):
        return "REDIS_UNREACHABLE"
    if isinstance(exc, CapacityError):
        return "KV_CAPACITY"
    if isinstance(exc, (KVImportError, BadHandle)):
        return "BAD_HANDOFF"
    return code.name


def field_of(exc: BaseException, message: str) -> str:
    """The request field an INVALID_ARGUMENT names: the error's own, or its message's "field: ..."."""
    field = getattr(exc, "field", "") or ""
    if not field and ": " in message:
        head = message.split(": ", 1)[0]
        field = head if head and " " not in head else ""
    return field


def status_details(code: grpc.StatusCode, message: str, exc: BaseException, metadata) -> bytes:
    """google.rpc.Status for the trailers (grpc-status-details-bin), with the message the status
    carries: ErrorInfo (reason, domain) always; BadRequest naming the field on INVALID_ARGUMENT;
    RetryInfo on RESOURCE_EXHAUSTED and UNAVAILABLE, from the retry hint (grpc-retry-pushback-ms
    stays beside it, for gRPC's own retries)."""
    st = status_pb2.Status(code=code.value[0], message=message)
    st.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason_of(exc, code), domain=ERROR_DOMAIN))
    if code == grpc.StatusCode.INVALID_ARGUMENT and (field := field_of(exc, message)):
        description = message.removeprefix(f"{field}: ")[:MAX_VIOLATION_CHARS]
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
        st.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        hint = dict(metadata).get("retry-after-ms")
        ms = int(hint) if hint and str(hint).isdigit() else UNAVAILABLE_RETRY_MS
        delay = duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)
        st.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return st.SerializeToString()


async def _abort(context, exc: BaseException):
    code, message, metadata = status_for(exc)
    message = fit_details(message)
    details = ((STATUS_DETAILS_KEY, status_details(code, message, exc, metadata)),)
    context.set_trailing_metadata(tuple(metadata) + details)
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except Exception:  # noqa: BLE001 - gRPC's ExecuteBatchError (a private type): no status could be sent
        # The RPC ended as the handler failed: its deadline passed (the upstream call the handler
        # waited on had the same deadline) or its client went. Its client has its own status;
        # gRPC would log this as an error of the servicer, and as a cancel, it says nothing.
        if _ended(context):
            raise asyncio.CancelledError(f"{code.name} ({message}) not sent: the RPC had ended") from None
        raise


def _ended(context) -> bool:
    return context.time_remaining() == 0 or context.cancelled() or context.done()


# gRPC's aio server logs this, with a traceback, when a handler has returned and the status it
# sends fails because the call has just ended (its client went as the status went out: gRPC had
# not yet heard). Nothing was lost: the handler had finished, and the client has its own status.
ENDED_CALL_LOG = "ExecuteBatchError raised in core by servicer method"


class _EndedCalls(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith(ENDED_CALL_LOG):
            record.msg = f"{record.getMessage()}: its status was not sent, the call had ended (its client went)"
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_ended_calls() -> None:
    """One line at INFO, not an ERROR with a traceback, for a status gRPC could not send because
    its call had just ended (ENDED_CALL_LOG)."""
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _EndedCalls) for f in grpc_log.filters):
        grpc_log.addFilter(_EndedCalls())


class SlowReader(Refused):
    """A streaming client read no message for the server's write timeout."""


async def _write(context, message, timeout_s: float = 0.0) -> None:
    """A streaming handler's next message. One that cannot be written because the RPC has ended
    (its deadline passed, or its client went, as the handler made it: gRPC had not yet cancelled
    the handler) ends the handler as a cancel: its client has its own status. With timeout_s, a
    message the client's flow control holds back that long ends the RPC RESOURCE_EXHAUSTED
    (SLOW_READER): the messages sent before it, then that status, are what the client reads."""
    try:
        if timeout_s:
            try:
                await asyncio.wait_for(context.write(message), timeout_s)
            except TimeoutError:
                raise SlowReader(
                    f"the client read no message for {timeout_s:g} s (slow_reader_timeout_s): the request "
                    f"was ended and its KV freed",
                    reason="SLOW_READER",
                ) from None
        else:
            await context.write(message)
    except SlowReader:
        raise
    except Exception as e:  # noqa: BLE001 - gRPC's ExecuteBatchError (a private type) for a call that is over
        if type(e).__name__ == "ExecuteBatchError" or _ended(context):
            raise asyncio.CancelledError(f"a message not sent: the RPC had ended ({e})") from None
        raise


async def _guarded(context, make_awaitable):
    """Await the handler; a domain error becomes the right status."""
    try:
        return await make_awaitable()
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as e:  # noqa: BLE001 - mapped to a status
        await _abort(context, e)


class Malformed:
    """A request message that did not parse (bad wire format, a string that is not UTF-8)."""

    def __init__(self, error: Exception, type_name: str):
        self.message = f"the request does not parse as {type_name}: {error}"


def _tolerant(des, method: str):
    """The handler's deserializer, returning Malformed instead of raising: gRPC would answer a
    deserializer's exception with UNKNOWN, and the client's mistake is INVALID_ARGUMENT."""
    if des is None:
        return None
    descriptor = getattr(getattr(des, "__self__", None), "DESCRIPTOR", None)
    type_name = descriptor.full_name if descriptor is not None else f"the request of {method}"

    def deserialize(data: bytes):
        try:
            return des(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, or anything a parser raises
            return Malformed(e, type_name)

    return deserialize


def _check(request) -> None:
    if isinstance(request, Malformed):
        raise Invalid(request.message)


async def _checked(request_iterator):
    async for request in request_iterator:
        _check(request)
        yield request


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler so a domain error becomes the right status, never a crash. write_timeout_s:
    a streaming handler's message its client's flow control holds back longer ends the RPC (_write)."""

    def __init__(self, write_timeout_s: float = 0.0):
        self.write_timeout_s = write_timeout_s

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        des, ser = _tolerant(handler.request_deserializer, details.method), handler.response_serializer

        def awaited(inner):
            """A handler that returns its answer, or writes its messages with context.write."""

            async def call(request, context):
                async def run():
                    _check(request)
                    return await inner(request, context)

                return await _guarded(context, run)

            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(awaited(handler.unary_unary), des, ser)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(request_iterator, context):
                return await _guarded(context, lambda: inner_su(_checked(request_iterator), context))

            return grpc.stream_unary_rpc_method_handler(stream_unary, des, ser)
        if handler.unary_stream and not inspect.isasyncgenfunction(handler.unary_stream):  # e.g. Health.Watch
            return grpc.unary_stream_rpc_method_handler(awaited(handler.unary_stream), des, ser)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            async def unary_stream(request, context):
                """The handler's messages are written here, not yielded to gRPC: a write that fails
                as the RPC ends (_write) ends the handler as a cancel, and its generator is closed
                now, its cleanup run. Yielded, gRPC logged that as an error of the servicer, with a
                traceback (a soak: a decode worker's stream whose 0.05-1 s deadline passed as its
                first message was written)."""
                items = None
                try:
                    _check(request)
                    items = inner_s(request, context)
                    async for item in items:
                        await _write(context, item, self.write_timeout_s)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as e:  # noqa: BLE001 - mapped to a status
                    if items is not None:  # first: the status waits for the client to read what is before it
                        await items.aclose()
                        items = None
                    await _abort(context, e)
                finally:
                    if items is not None:
                        await items.aclose()

            return grpc.unary_stream_rpc_method_handler(unary_stream, des, ser)
        return handler
