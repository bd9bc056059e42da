"""The only contract between the GUI (or terminal client) and the worker process.

Requests go to the worker, events come back; both are frozen dataclasses, each
carrying the `request_id` it belongs to (events the worker sends on its own,
such as `Ready` and idle `Stats`, carry ""). On the wire every message is a
JSON object, `{"v": PROTOCOL_VERSION, "type": "Generate", …}`, so neither
side ever unpickles anything (or imports the other's libraries), and `decode`
checks every field's type: a malformed or unknown message becomes a
`ProtocolError` (the worker answers it with an `Error` event and keeps
serving), and a message from another protocol version is refused by name.

This module imports neither torch nor Qt.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from engine.config import OffloadConfig
from engine.errors import EngineError
from engine.generation_config import CompletionPrompt, GenerationConfig, PromptEcho, TokenLogprob

# 2: Tune, TuneProgress, TuneResult; 3: reasoning apart from the answer, tools; 4: Finished.tool_calls,
# GenerationConfig.tool_choice, OffloadConfig.kv_dtype; 5: OffloadConfig.kernels; 6: logprobs
# (GenerationConfig.logprobs, Token.logprobs), completion prompts (Generate.completion, Token.echo)
PROTOCOL_VERSION = 6


class ProtocolError(EngineError):
    kind = "protocol"


class ProtocolVersionError(ProtocolError):
    kind = "protocol_version"


# ---- requests (client → worker) ------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str
    # an assistant's calls: {"id", "type": "function", "function": {"name", "arguments": {…}}}
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class LoadModel:
    """Load a model folder (None: the bundled demo model), replacing any loaded model."""

    request_id: str
    model_dir: str | None = None
    offload: OffloadConfig = OffloadConfig()


@dataclass(frozen=True)
class Generate:
    """Reply to a conversation; answered by `Token` events and one `Finished` (or `Error`)."""

    request_id: str
    messages: tuple[ChatMessage, ...]
    config: GenerationConfig = GenerationConfig()
    # a prompt continued as written, with no chat template, in place of the messages (/v1/completions)
    completion: CompletionPrompt | None = None


@dataclass(frozen=True)
class Cancel:
    """Stop the load or generation `target_id` (within one decode or verify step)."""

    request_id: str
    target_id: str


@dataclass(frozen=True)
class GetStats:
    """Answered at once by one `Stats` event."""

    request_id: str


@dataclass(frozen=True)
class Tune:
    """Auto-tune the loaded model on this machine; answered by TuneProgress events and a TuneResult.

    A stored result for the same GPU, model, budget and precision is returned at once unless
    `retune`; `Cancel` stops it between measurements."""

    request_id: str
    draft_model: str | None = None  # None: the demo draft for the demo model, else self-speculation
    new_tokens: int = 32  # generated per calibration prompt and measured point
    retune: bool = False


@dataclass(frozen=True)
class Shutdown:
    """Cancel what runs, free the model and exit with status 0."""

    request_id: str


Request = LoadModel | Generate | Cancel | GetStats | Tune | Shutdown

# ---- events (worker → client) --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # cuda | cpu
    name: str
    total_memory_bytes: int | None  # None: not known (a CPU device shares host RAM)
    torch_version: str


@dataclass(frozen=True)
class Ready:
    """The worker's first event: it speaks `protocol_version` and will run on `device`."""

    request_id: str
    protocol_version: int
    pid: int
    device: DeviceInfo


@dataclass(frozen=True)
class LoadProgress:
    request_id: str
    stage: str  # e.g. "experts", "weights"
    done: int
    total: int


@dataclass(frozen=True)
class Loaded:
    request_id: str
    model: dict[str, Any]  # OffloadedModel.info() (architecture, layers, experts, cache slots …) and
    #                       "thinks": its replies open with a <think> block (a Think toggle applies)
    load_s: float


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not an error (e.g. a retry with a smaller cache)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Token:
    request_id: str
    text: str  # new complete answer text since the previous Token (may be "")
    token_id: int
    index: int  # 0 for the first generated token
    elapsed_ms: float  # since the previous token (the first: since the request arrived)
    reasoning: str = ""  # new reasoning text (a `<think>` block), apart from the answer
    # the log-probabilities of the tokens this event stands for, when the request asked for them
    logprobs: tuple[TokenLogprob, ...] = ()
    echo: PromptEcho | None = None  # on the first Token, when a completion prompt asked for its echo


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: str  # eos | stop | length | cancelled; a remote engine's also tool_calls | interrupted
    text: str  # the whole answer
    tail: str  # text not yet sent in a Token event: a streaming client appends it
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]  # GenerationStats.to_dict()
    reasoning: str = ""  # the whole reasoning; its part not yet sent in a Token is `reasoning_tail`
    reasoning_tail: str = ""
    # the calls a remote engine returned as OpenAI tool_calls, or the local engine read from a model's
    # own call messages (gpt-oss's harmony), in ChatMessage.tool_calls' form (arguments an object, or
    # the text as written when it is not JSON); calls a model writes as text (`<tool_call>`) stay in `text`
    tool_calls: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Stats:
    """Live telemetry (see engine.worker.telemetry): ~4 Hz while generating, ~1 Hz idle.

    A field is None when it is not known on this machine (no GPU, no NVML, no model)."""

    request_id: str
    time_s: float  # worker's monotonic clock
    generating: bool
    simulated_link: bool | None  # None: no model loaded
    vram_used_bytes: int | None  # NVML: the whole device
    vram_total_bytes: int | None
    torch_allocated_bytes: int | None  # torch's allocator: this process
    torch_reserved_bytes: int | None
    host_ram_used_bytes: int
    host_ram_total_bytes: int
    process_rss_bytes: int
    h2d_bytes: int  # counted by the engine, since the model was loaded
    h2d_gbps: float | None  # counted, over the last interval
    pcie_rx_gbps: float | None  # NVML's sampled counters, beside the counted figure
    pcie_tx_gbps: float | None
    hits: int  # since the model was loaded
    misses: int
    hit_rate: float | None  # over the last interval
    hit_rate_total: float | None
    hit_rate_by_phase: dict[str, float | None]  # cumulative, per phase
    generated_tokens: int  # in the current (or last) generation
    tokens_per_s: float | None  # over the last interval
    tpot_ms: float | None  # current generation so far
    accept_len: float | None
    prefetch_precision: float | None
    prefetch_recall: float | None
    cutoff_layer: int | None
    cache_slots_used: int | None
    cache_slots_total: int | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TuneProgress:
    request_id: str
    stage: str  # probe | profile stages (copy, layer, draft, verify, memory, acceptance) | search
    done: int
    total: int


@dataclass(frozen=True)
class TuneResult:
    request_id: str
    result: dict[str, Any]  # engine.tune.types.TuneResult as a dict: probe, profile, prediction,
    #                         measured, choice, key, reused


@dataclass(frozen=True)
class Error:
    request_id: str
    kind: str  # EngineError.kind: invalid_request, model_not_found, protocol, internal, …
    message: str


Event = Ready | LoadProgress | Loaded | Notice | Token | Finished | Stats | TuneProgress | TuneResult | Error

_REQUEST_TYPES = (LoadModel, Generate, Cancel, GetStats, Tune, Shutdown)
_EVENT_TYPES = (Ready, LoadProgress, Loaded, Notice, Token, Finished, Stats, TuneProgress, TuneResult, Error)
MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (*_REQUEST_TYPES, *_EVENT_TYPES)}
REQUESTS = frozenset(cls.__name__ for cls in _REQUEST_TYPES)


# ---- wire format ----------------------------------------------------------------------------------


def encode(message: Request | Event) -> dict[str, Any]:
    """The wire form of a message: a dict of builtins, tagged with its type and the version."""
    if type(message).__name__ not in MESSAGES:
        raise ProtocolError(f"{type(message).__name__} is not a protocol message.")
    return {"v": PROTOCOL_VERSION, "type": type(message).__name__, **_to_wire(message)}


def decode(wire: object, expect: str = "any") -> Request | Event:
    """The message a wire dict stands for; `expect` 'request' or 'event' refuses the other kind.

    Raises `ProtocolVersionError` for another version and `ProtocolError` for anything malformed."""
    if not isinstance(wire, dict):
        raise ProtocolError(f"A message must be a dict, got {type(wire).__name__}.")
    version = wire.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"Protocol version mismatch: the other side speaks version {version!r}, this side "
            f"{PROTOCOL_VERSION}. Reinstall MoE Chat so the app and its engine match."
        )
    name = wire.get("type")
    cls = MESSAGES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"Unknown message type {name!r}.")
    if expect != "any" and (name in REQUESTS) != (expect == "request"):
        raise ProtocolError(f"{name} is not a{'' if expect == 'event' else ' request'} {expect}.")
    body = {k: v for k, v in wire.items() if k not in ("v", "type")}
    return _from_wire(cls, body, name)


def dumps(message: Request | Event) -> bytes:
    return json.dumps(encode(message), ensure_ascii=False).encode("utf-8")


def loads(data: bytes, expect: str = "any") -> Request | Event:
    try:
        wire = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProtocolError(f"A message is not valid JSON: {err}") from err
    return decode(wire, expect)


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(cls: type, body: object, where: str) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(body).__name__}.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}.")
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = required - set(body)
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {', '.join(sorted(missing))}.")
    values = {name: _value(hints[name], value, f"{where}.{name}") for name, value in body.items()}
    return cls(**values)


def _value(hint: Any, value: object, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _value(option, value, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {value!r} is not a {hint}.")
    if dataclasses.is_dataclass(hint):
        return _from_wire(hint, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}.")
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):  # tuple[X, Y]: one of each
            raise ProtocolError(f"{where}: expected {len(args)} items, got {len(value)}.")
        return tuple(_value(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict or hint is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"{where}: expected an object with string keys.")
        item = args[1] if args else Any
        return {k: _value(item, v, f"{where}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise ProtocolError(f"{where}: expected a number, got a boolean.")
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise ProtocolError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}.")
