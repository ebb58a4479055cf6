"""The shared engine: model, paged KV cache, scheduler and sampler.

Both kinds of worker run it; it also runs whole in one process (``LLMEngine``).
"""

from splitserve.engine.config import EngineConfig, ModelSpec
from splitserve.engine.errors import EngineError, InvalidRequestError, KVImportError, ModelLoadError
from splitserve.engine.outputs import RequestOutput, StepStats
from splitserve.engine.params import SamplingParams

__all__ = [
    "EngineConfig",
    "EngineError",
    "InvalidRequestError",
    "KVImportError",
    "ModelLoadError",
    "ModelSpec",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
]
