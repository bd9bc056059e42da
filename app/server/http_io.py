"""What every route of the server does over HTTP, whichever API it speaks: read a JSON body within
a size limit, run a whole reply in a thread that a departing client cancels, and send a streamed
reply as server-sent events (OpenAI's APIs) or as newline-delimited JSON (Ollama's).

A streamed reply's first item is made before the response starts, so an error until then still has
its own HTTP status; closing the items' iterator (always, also when the client went) cancels the
generation behind them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from sse_starlette import EventSourceResponse

from app.server.schemas import ApiError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024**2
DISCONNECT_POLL_S = 0.25

Items = Iterator[dict[str, Any]]


async def json_body(request: Request) -> object:
    """The request's decoded JSON body; a body that is not JSON, too large or too deep is an `ApiError`.

    The body is read as JSON whatever its Content-Type (curl's `-d`, as in Ollama's and llama.cpp's
    examples, says form data), except from a web page: a browser names the page's `Origin` on every
    POST, and such a request must say `application/json`, which a page cannot send to another origin
    without a preflight this server never grants.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json" and "origin" in request.headers:
        raise ApiError(415, "A request from a web page must send JSON as Content-Type: application/json.")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")
    data = b""
    async for part in request.stream():
        data += part
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ApiError(400, f"We could not parse the JSON body of your request: {err}.") from None
    except RecursionError:
        raise ApiError(400, "The JSON body of your request is nested too deeply.") from None


async def openai_reply(request: Request, api: object, whole: str, streamed: str):
    """An OpenAI route's answer to the body of `request`: `api.<streamed>(body)` as server-sent
    events when the body says `"stream": true`, else `api.<whole>(body, cancelled)` as JSON."""
    body = await json_body(request)
    if isinstance(body, dict) and body.get("stream") is True:
        return await sse_response(getattr(api, streamed)(body))
    return await run_cancellable(lambda cancelled: getattr(api, whole)(body, cancelled), request)


async def run_cancellable(call: Callable[[threading.Event], Any], request: Request) -> Any:
    """`call(cancelled)` in a thread; a client that disconnects meanwhile sets `cancelled`."""
    cancelled = threading.Event()
    outcome: dict[str, Any] = {}

    async def run(scope: anyio.CancelScope) -> None:
        try:
            outcome["reply"] = await anyio.to_thread.run_sync(call, cancelled)
        except Exception as err:  # raised below, outside the task group (which would wrap it)
            outcome["error"] = err
        scope.cancel()

    async def watch() -> None:
        while not await request.is_disconnected():
            await anyio.sleep(DISCONNECT_POLL_S)
        log.info("POST %s: the client disconnected; its generation is cancelled", request.url.path)
        cancelled.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run, group.cancel_scope)
        group.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["reply"]


async def sse_response(
    items: Items,
    done: bool = True,
    event_name: Callable[[dict], str | None] | None = None,
    error_item: Callable[[ApiError], dict] = ApiError.body,
) -> EventSourceResponse:
    """Server-sent events, one a `data:` line of JSON; `event_name` names each event (the Responses
    API's `event:` lines), `done` ends with `data: [DONE]` (chat and completions), and an error once
    the status is sent becomes the event `error_item` makes of it."""
    first = await _first(items)

    async def events() -> AsyncIterator[dict[str, str]]:
        async for item in _rest(first, items, error_item):
            name = event_name(item) if event_name is not None else None
            yield {"data": json.dumps(item, ensure_ascii=False), **({"event": name} if name else {})}
        if done:
            yield {"data": "[DONE]"}

    return EventSourceResponse(events(), ping=15, sep="\n")


async def ndjson_response(items: Items, error_item: Callable[[ApiError], dict]) -> StreamingResponse:
    """Newline-delimited JSON, a line an item, as Ollama streams (`application/x-ndjson`)."""
    first = await _first(items)

    async def lines() -> AsyncIterator[bytes]:
        async for item in _rest(first, items, error_item):
            yield (json.dumps(item, ensure_ascii=False) + "\n").encode("utf-8")

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _first(items: Items) -> dict[str, Any]:
    try:
        return await anyio.to_thread.run_sync(next, items)
    except BaseException:
        await anyio.to_thread.run_sync(items.close)
        raise


async def _rest(first: dict, items: Items, error_item: Callable[[ApiError], dict]) -> AsyncIterator[dict]:
    """`first`, then the rest of `items` (an `ApiError` among them ends them as its error item);
    closed at the end whatever happened, the client's departure included."""
    done = object()
    try:
        item = first
        while item is not done:
            yield item
            try:
                item = await anyio.to_thread.run_sync(next, items, done)
            except ApiError as err:  # the status is sent already: the client reads an error item
                yield error_item(err)
                return
    finally:
        with anyio.CancelScope(shield=True):  # the client may be gone: still cancel the generation
            await anyio.to_thread.run_sync(items.close)
            log.debug("A stream ended (finished, failed or the client disconnected)")
