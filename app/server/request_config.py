"""A checked request (`ChatRequest`) and its generation settings, as chat and text completions
share them: the sampling parameters over the server's defaults, the stop strings, the length,
and one config a choice when a request asks for `n` of them; the HTTP errors of a request for
another model and of the engine's errors.

The `n` choices are generated one after another (the engine runs one reply at a time); a seeded
request gives choice `i` the seed `seed + i`, so the choices differ and the whole reply still
repeats for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.server.schemas import ApiError, SamplingRequest, invalid
from engine.errors import EngineError
from engine.generation_config import SEED_LIMIT, CompletionPrompt, GenerationConfig, SamplingConfig
from engine.worker.client import EngineBusy, WorkerDied
from engine.worker.protocol import ChatMessage

CLIENT_ERRORS = ("invalid_request", "invalid_config", "context_length_exceeded")


def model_not_found(asked: object, served: str) -> ApiError:
    message = f"The model {asked!r} does not exist; this server has {served!r}."
    return ApiError(404, message, param="model", code="model_not_found")


def api_error(err: EngineError) -> ApiError:
    """The HTTP face of an engine error."""
    if isinstance(err, WorkerDied):
        message = f"{err} The engine is being restarted: try again in a few seconds."
        return ApiError(503, message, "server_error", code="engine_unavailable")
    if isinstance(err, EngineBusy):
        return ApiError(503, str(err), "server_error", code=err.kind)
    if err.kind in CLIENT_ERRORS:
        param = "messages" if err.kind == "context_length_exceeded" else None
        return ApiError(400, str(err), param=param, code=err.kind)
    return ApiError(500, str(err), "server_error", code=err.kind)


@dataclass(frozen=True)
class ChatRequest:
    """A checked request: what the engine is asked for, and how the reply goes back."""

    model: str
    messages: tuple[ChatMessage, ...]
    config: GenerationConfig
    stream: bool
    include_usage: bool
    n: int = 1  # choices, generated one after another
    completion: CompletionPrompt | None = None  # a prompt continued as written, in place of messages


def served_model(request: SamplingRequest, model_id: str) -> str:
    """The model a request names: the served one (the default), else a 404."""
    model = request.model if request.model is not None else model_id
    if model != model_id:
        raise model_not_found(model, model_id)
    return model


def checked_request(
    request: SamplingRequest,
    model: str,
    messages: tuple[ChatMessage, ...],
    config: GenerationConfig,
    completion: CompletionPrompt | None = None,
) -> ChatRequest:
    """The `ChatRequest` for a parsed request, its config checked as the engine checks it."""
    try:
        config.validate()
    except EngineError as err:
        raise api_error(err) from err
    stream = request.stream is True
    include_usage = (
        stream and request.stream_options is not None and request.stream_options.include_usage is True
    )
    return ChatRequest(model, messages, config, stream, include_usage, request.n or 1, completion)


def request_config(
    request: SamplingRequest, defaults: GenerationConfig, max_tokens: int | None
) -> GenerationConfig:
    """`defaults` with what the request sets: its sampling, `max_tokens` and stop strings."""
    config = replace(defaults, sampling=_sampling(request, defaults.sampling))
    if max_tokens is not None:
        config = replace(config, max_new_tokens=max_tokens)
    if request.stop is not None:
        stops = [request.stop] if isinstance(request.stop, str) else request.stop
        if not stops or not all(stops):
            raise invalid("stop must be a non-empty string or an array of them.", "stop")
        config = replace(config, stop_strings=tuple(stops))
    return config


def _sampling(request: SamplingRequest, sampling: SamplingConfig) -> SamplingConfig:
    if request.temperature is not None:  # the request's choice wins over --greedy; 0 means greedy
        sampling = replace(sampling, temperature=request.temperature, greedy=False)
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(request, name) is not None:
            sampling = replace(sampling, **{name: getattr(request, name)})
    if request.top_k is not None:
        sampling = replace(sampling, top_k=max(request.top_k, 0))  # vLLM's -1 is off, as 0 is here
    if "seed" in request.model_fields_set:
        sampling = replace(sampling, seed=request.seed)
    if request.logit_bias:
        sampling = replace(sampling, logit_bias=request.token_biases())
    return sampling


def choice_configs(config: GenerationConfig, n: int) -> list[GenerationConfig]:
    """One config a choice: the same settings, the seed (when there is one) offset by the choice's
    index, wrapping within the engine's seed range."""
    seed = config.sampling.seed
    if n == 1 or seed is None:
        return [config] * n
    return [
        replace(config, sampling=replace(config.sampling, seed=(seed + i) % SEED_LIMIT)) for i in range(n)
    ]
