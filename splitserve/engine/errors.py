"""Domain errors of the engine. Servers map them to gRPC status codes in one place."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The model could not be found, read or is of an unsupported architecture."""


class InvalidRequestError(EngineError, ValueError):
    """A request (or one of its fields) is invalid. ``field`` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class KVImportError(EngineError, ValueError):
    """Exported KV cannot be imported here (layout, dtype, fingerprint or size mismatch, or a sequence
    that does not go with it). ``field`` names the culprit as the handoff's proto does
    (``handle.length``, ``sequence.logprobs``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class CapacityError(EngineError):
    """The request can never fit in this engine's KV pool or context."""


class KVPrefixMissing(EngineError):
    """KV sent without its first tokens (they were expected to be in this engine's prefix
    cache) finds fewer of them cached: the sender is to send them too."""

    def __init__(self, held: int, start: int):
        super().__init__(f"the prefix cache holds {held} of the first {start} tokens, whose KV was not sent")
        self.held, self.start = held, start


class StepFailed(EngineError):
    """An engine step failed for this sequence even when run without the others (or its token
    could not be taken): it ends "error"; the others of the step go on."""

    def __init__(self, cause: BaseException):
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")


def in_halves(a: int, b: int, error: Exception, run, then, alone) -> list:
    """A step's run of items [a, b) raised `error`: each half is run again (run(lo, hi), whose
    result goes to then()), and each half that raises is halved again, down to the items that
    raise alone (alone(i, its error)). What then() and alone() return, in the items' order. A step
    that fails for all costs 2n - 1 runs; one item that fails it, about 2 log2(n)."""
    if b - a == 1:
        return [alone(a, error)]
    out, mid = [], (a + b) // 2
    for lo, hi in ((a, mid), (mid, b)):
        try:
            got = run(lo, hi)
        except Exception as e:  # noqa: BLE001 - narrowed down further
            out += in_halves(lo, hi, e, run, then, alone)
        else:
            out.append(then(got))
    return out
