"""The copy pipeline of one MoE layer: experts brought into the cache, yielded as they are ready.

`ready_experts(cache, layer, experts, …)` pins each expert's slot in the order given
(hits first, so misses' copies overlap the hits' compute), and yields `(expert, weights)`
oldest first; a slot is released when the consumer asks for the next expert (or when the
generator is closed, after an error). Like mixtral-offloading's `load_experts`, the
consumer's compute of one expert overlaps the copies of the next ones.

A step that streams (`ExpertCache.streams`) keeps at most `STREAM_DEPTH` streamed experts
pinned at once: one computing while the next is on the link. Once its own copies are all
issued, the spare slots its computed experts free take the next layer's likely experts
(`lookahead`, SP-MoE's policy), so the link never idles while this layer finishes.

`pinned_together(cache, layer, experts)` pins them all at once and leaves their release to the
caller (engine.decode.piecewise_step: released once the step's next piece has read them).

`ready_together(cache, layer, experts, limit)` pins them in groups instead (`engine.moe.batched_experts`
computes a group in a few batched kernels): each group as many as `limit` or as the cache can pin at
once, yielded once every copy of it has landed, released when the consumer asks for the next group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.device_cache.eviction import ExpertKey
from engine.device_cache.expert_cache import STREAM_DEPTH, ExpertCache, NoEvictableSlot, Slot
from engine.errors import BudgetTooSmallError

Lookahead = Callable[[], list[ExpertKey]]  # the next layer's experts to stream in, likeliest first


@dataclass(frozen=True)
class _Pinned:
    expert: int
    slot: Slot
    streamed: bool  # holds one of the step's `STREAM_DEPTH` stream slots


def ready_experts(
    cache: ExpertCache,
    layer: int,
    experts: list[int],
    *,
    streaming: bool = False,
    lookahead: Lookahead | None = None,
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """`(expert, weights)` for each of `layer`'s `experts`, in order, each once its copy has landed.

    Raises `BudgetTooSmallError` when every slot is pinned by other work."""
    pending: deque[_Pinned] = deque()  # pinned, in acquire order
    ahead: list[ExpertKey] = []

    def oldest() -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        pinned = pending.popleft()
        try:
            yield pinned.expert, cache.wait(pinned.slot)
        finally:
            cache.release(pinned.slot)
        if pinned.streamed:  # a stream slot came free: the next layer's experts may take it
            _issue(cache, ahead)

    try:
        for expert in experts:
            streamed = streaming and cache.streamed((layer, expert))
            while streamed and sum(p.streamed for p in pending) >= STREAM_DEPTH:
                yield from oldest()
            while (slot := _try_acquire(cache, (layer, expert), streaming, bool(pending))) is None:
                yield from oldest()  # every slot is pinned by this layer: compute one to free it
            pending.append(_Pinned(expert, slot, streamed))
        if lookahead is not None:  # this layer's copies are all issued: the next layer's may go
            ahead.extend(lookahead()[:STREAM_DEPTH])
            _issue(cache, ahead)
        while pending:
            yield from oldest()
    finally:
        for pinned in pending:  # only after an error or an early close: never leave a slot pinned
            cache.release(pinned.slot)


def ready_together(cache: ExpertCache, layer: int, experts: list[int], limit: int) -> Iterator[list[Slot]]:
    """`layer`'s `experts` in order, in groups of pinned slots whose copies have landed (on CUDA:
    the compute stream waits for them). A group ends at `limit` experts, or where the next would
    need a slot that only releasing this group frees. Raises `BudgetTooSmallError` as
    `ready_experts` does."""
    start = 0
    while start < len(experts):
        group: list[Slot] = []
        try:
            for expert in experts[start : start + limit]:
                slot = _try_acquire(cache, (layer, expert), False, bool(group))
                if slot is None:
                    break
                group.append(slot)
            for slot in group:
                cache.wait(slot)
            yield group
        finally:
            for slot in group:
                cache.release(slot)
        start += len(group)


def pinned_together(
    cache: ExpertCache, layer: int, experts: list[int], wait: bool = True, streaming: bool = False
) -> list[Slot]:
    """`layer`'s `experts` pinned in slots, misses' copies issued and, with `wait`, landed (on
    CUDA: the compute stream waits for them; else the caller calls `cache.wait` on each): the
    caller releases them; `streaming`: misses beyond the layer's share load as transient
    (`ExpertCache.acquire`). Raises `BudgetTooSmallError` where the cache cannot hold them at once."""
    slots: list[Slot] = []
    try:
        for expert in experts:
            slot = _try_acquire(cache, (layer, expert), streaming, bool(slots))
            if slot is None:
                raise BudgetTooSmallError(
                    f"The expert cache cannot hold layer {layer}'s {len(experts)} routed experts at once. "
                    "Raise --expert-budget."
                )
            slots.append(slot)
        for slot in slots if wait else ():
            cache.wait(slot)
    except BaseException:
        for slot in slots:
            cache.release(slot)
        raise
    return slots


def _try_acquire(cache: ExpertCache, key: ExpertKey, streaming: bool, has_pending: bool) -> Slot | None:
    """`key`'s pinned slot; None when the caller must first compute one of its own pinned experts."""
    while True:
        try:
            return cache.acquire(key, streaming)
        except NoEvictableSlot:
            if has_pending:
                return None
            if not cache.wait_for_a_copy():  # a prefetch in flight landed: its slot can go now
                raise BudgetTooSmallError(
                    f"Every expert cache slot is busy; layer {key[0]} cannot load expert {key[1]}. "
                    "Raise --expert-budget."
                ) from None


def _issue(cache: ExpertCache, ahead: list[ExpertKey]) -> None:
    """Stream the next layer's experts into spare slots, in order, while some are free."""
    while ahead and (ahead[0] in cache or cache.prefetch(ahead[0], spare_only=True)):
        ahead.pop(0)
