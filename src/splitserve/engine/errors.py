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
    """Exported KV cannot be imported here (layout, dtype, fingerprint or size mismatch)."""


class CapacityError(EngineError):
    """The request can never fit in this engine's KV pool or context."""
