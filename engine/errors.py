"""The engine's errors: one family, each message says what went wrong and what to do.

Callers (the CLI, the worker, the GUI) catch `EngineError` and show `str(err)`;
`kind` is a stable machine-readable name for the protocol.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine reports to a user."""

    kind = "engine"


class ModelNotFoundError(EngineError):
    kind = "model_not_found"


class InvalidConfigError(EngineError):
    kind = "invalid_config"


class UnsupportedArchitectureError(EngineError):
    kind = "unsupported_architecture"


class CorruptCheckpointError(EngineError):
    kind = "corrupt_checkpoint"


class MissingTensorsError(EngineError):
    kind = "missing_tensors"


class BudgetTooSmallError(EngineError):
    kind = "budget_too_small"


class DeviceOutOfMemoryError(EngineError):
    kind = "device_out_of_memory"
    cache_slots: int | None = None  # the expert cache size that did not fit, when one was tried
    tokens_sent: int = 0  # tokens of the reply already streamed when generation ran out of memory


class InvalidRequestError(EngineError):
    """A generation or engine option outside its allowed range."""

    kind = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """The prompt fills the context window (the model's, or a smaller one the request set)."""

    kind = "context_length_exceeded"

    # defaults: pickle and copy rebuild an exception from its message, then restore these
    def __init__(self, message: str, context_length: int | None = None, prompt_tokens: int | None = None):
        super().__init__(message)
        self.context_length = context_length  # the window that applied, in tokens
        self.prompt_tokens = prompt_tokens


class GenerationCancelled(EngineError):
    kind = "cancelled"


class UnsupportedQuantizationError(EngineError):
    """A quantized tensor of a type the engine cannot dequantize (e.g. a GGUF type with no entry)."""

    kind = "unsupported_quantization"
