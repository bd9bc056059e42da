"""Asynchronous host→device copies that complete on an event.

`copy(dst, src, after)` starts a copy and returns a `CopyHandle`; the compute
side calls `handle.wait()` before reading `dst`. Two implementations share
that contract:

- `CudaTransfer`: a dedicated copy stream; a store too big to pin passes each copy through a
  pinned `StagingRing` (engine.store.staging) first. Each copy first waits for `after`
  (the event recorded when the slot's previous user finished on the compute
  stream), then records its own CUDA event. `wait()` makes the *compute
  stream* wait on that event: the host does not block. `synchronize()` blocks
  the host on the event itself (a blocking-sync event: the thread sleeps, it
  never spins on `query()`).
- `SimulatedLink`: for machines without a GPU. A link thread performs each
  copy with a real memcpy, then holds it until the time a link of the given
  bandwidth and latency would have delivered it (copies are serialised, as on
  one PCIe link). `wait()` blocks the host until then. Everything measured
  over it is labelled simulated.

A `LinkMeter` set on an engine (`meter`, for a block: `metered`) sums its copy time and compute's
waits for copies.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.store.host_store import ExpertStore
from engine.store.staging import STAGING_SLOTS, StagingRing

log = logging.getLogger(__name__)


COPY_TIMEOUT_S = 120.0  # no copy of one expert takes this long: a link that stalls this long is broken


IDLE_POLL_S = 1.0  # how often an idle simulated link looks whether it was closed


class CopyTimeout(RuntimeError):
    """A copy did not land within `COPY_TIMEOUT_S`."""


class LinkMeter:
    """The link's copy time and the time compute waited for copies, summed over a run: what share
    of copying was hidden behind compute (`hidden`, the bench's column). On CUDA from timing events
    on the copy stream (each copy) and on the compute stream around each wait (the time the GPU sat
    waiting); on the simulated link from its modelled copy times and the host's waits. Summing
    never blocks: a CUDA event not yet reached stays pending for a later `settle`."""

    def __init__(self) -> None:
        self.copy_s = 0.0
        self.wait_s = 0.0
        self._pending: list[tuple[str, object, object]] = []  # (copy | wait, start event, end event)
        self._lock = threading.Lock()  # copies come from compute and from the prefetch worker

    def add(self, copy_s: float = 0.0, wait_s: float = 0.0) -> None:
        with self._lock:
            self.copy_s += copy_s
            self.wait_s += wait_s

    def add_events(self, kind: str, start, end) -> None:
        with self._lock:
            self._pending.append((kind, start, end))

    def settle(self) -> tuple[float, float]:
        """Copy seconds and wait seconds so far (every completed CUDA event counted)."""
        with self._lock:
            pending, self._pending = self._pending, []
            for kind, start, end in pending:
                if not end.query():
                    self._pending.append((kind, start, end))
                    continue
                seconds = start.elapsed_time(end) / 1e3
                if kind == "copy":
                    self.copy_s += seconds
                else:
                    self.wait_s += seconds
            return self.copy_s, self.wait_s

    @property
    def hidden(self) -> float | None:
        """1 − waited / copying (None without copies)."""
        copy_s, wait_s = self.settle()
        return None if copy_s <= 0 else max(0.0, 1.0 - wait_s / copy_s)


@contextmanager
def metered(transfer: TransferEngine) -> Iterator[LinkMeter]:
    """A fresh `LinkMeter` on `transfer` for the block; none after it, however it ends."""
    transfer.meter = meter = LinkMeter()
    try:
        yield meter
    finally:
        transfer.meter = None


class CopyHandle(ABC):
    @abstractmethod
    def wait(self) -> None:
        """Make the consumer wait until the copy has landed (on CUDA: the compute stream waits)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the copy has landed (or raise `CopyTimeout`)."""

    @abstractmethod
    def done(self) -> bool:
        """True once the copy has landed (never blocks)."""


class TransferEngine(ABC):
    simulated: bool
    meter: LinkMeter | None = None  # set for a measured run (the bench)

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: object | None = None) -> CopyHandle:
        """Start copying `src` (host) into `dst` (device) once `after` has passed."""

    def release_marker(self) -> object | None:
        """A marker recorded when compute has finished with a buffer (`after` of a later copy)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work."""


# -- CUDA ---------------------------------------------------------------------------------


class _CudaCopy(CopyHandle):
    def __init__(self, event: torch.cuda.Event, device: torch.device, meter: LinkMeter | None = None):
        self.event = event
        self.device = device
        self.meter = meter

    def wait(self) -> None:
        # The slot's device, not the current one: compute on cuda:1 runs on cuda:1's current stream.
        stream = torch.cuda.current_stream(self.device)
        if self.meter is None:
            stream.wait_event(self.event)
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self.event)
        after.record(stream)
        self.meter.add_events("wait", before, after)

    def synchronize(self) -> None:
        self.event.synchronize()  # created with blocking=True: the thread sleeps until the event

    def done(self) -> bool:
        return self.event.query()


class CudaTransfer(TransferEngine):
    simulated = False

    def __init__(self, device: torch.device, staging: StagingRing | None = None):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.staging = staging  # pageable sources pass through it; None: the store is pinned

    @property
    def staging_nbytes(self) -> int:
        return self.staging.nbytes if self.staging is not None else 0

    def copy(self, dst, src, after=None) -> CopyHandle:
        if self.staging is not None:
            return self.staging.stage(src, lambda pinned: self._start(dst, pinned, after))
        return self._start(dst, src, after)

    def _start(self, dst, src, after) -> CopyHandle:
        meter = self.meter
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            start = torch.cuda.Event(enable_timing=True) if meter is not None else None
            if start is not None:
                start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True, enable_timing=meter is not None)
            event.record(self.stream)
        if meter is not None:
            meter.add_events("copy", start, event)
        return _CudaCopy(event, self.device, meter)

    def release_marker(self) -> object:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


# -- simulated link -----------------------------------------------------------------------


class _SimCopy(CopyHandle):
    def __init__(self, meter: LinkMeter | None = None) -> None:
        self._landed = threading.Event()
        self.error: BaseException | None = None
        self.meter = meter

    def wait(self) -> None:
        start = time.perf_counter()
        if not self._landed.wait(COPY_TIMEOUT_S):
            raise CopyTimeout(f"A simulated copy did not land within {COPY_TIMEOUT_S:.0f} s.")
        if self.meter is not None:
            self.meter.add(wait_s=time.perf_counter() - start)
        if self.error is not None:
            raise self.error

    # the host is the consumer here: synchronizing is the same wait, bounded by COPY_TIMEOUT_S
    synchronize = wait

    def done(self) -> bool:
        return self._landed.is_set()


class SimulatedLink(TransferEngine):
    """A host→device link of `gbps` GB/s (1e9 bytes/s) and `latency_us` per copy.

    With `gbps=None` copies run at memcpy speed with no added delay.
    """

    simulated = True

    def __init__(self, gbps: float | None = None, latency_us: float = 0.0):
        self.gbps = gbps
        self.latency_s = latency_us / 1e6 if gbps is not None else 0.0
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._link_free_at = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sim-link", daemon=True)
        self._thread.start()

    def copy(self, dst, src, after=None) -> CopyHandle:
        if self._closed:
            raise RuntimeError("the simulated link is closed")
        handle = _SimCopy(self.meter)
        self._tasks.put((dst, src, handle, time.perf_counter()))
        return handle

    def _run(self) -> None:
        while True:
            try:  # bounded: a link whose close() sentinel is lost still ends
                task = self._tasks.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                if self._closed:  # the queue is empty: nothing queued before close() is dropped
                    return
                continue
            if task is None:
                return
            dst, src, handle, issued_at = task
            try:
                start = max(issued_at, self._link_free_at)
                copied_from = time.perf_counter()
                dst.copy_(src)
                copy_s = time.perf_counter() - copied_from  # without a bandwidth: at memcpy speed
                if self.gbps is not None:
                    landed_at = start + self.latency_s + src.numel() * src.element_size() / (self.gbps * 1e9)
                    copy_s = landed_at - start
                    delay = landed_at - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    self._link_free_at = landed_at
                if handle.meter is not None:
                    handle.meter.add(copy_s=copy_s)
            except BaseException as err:  # handed to the waiter, never lost in this thread
                handle.error = err
            handle._landed.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tasks.put(None)
        self._thread.join(timeout=5)


def make_transfer(
    device: torch.device, sim_link_gbps: float | None, sim_latency_us: float, store: ExpertStore | None = None
) -> TransferEngine:
    """The link to `device`; on CUDA, copies of an unpinned `store` are staged (a pinned ring)."""
    if device.type == "cuda":
        if sim_link_gbps is not None:
            log.warning("--sim-link-gbps is ignored on a CUDA device: copies use the real link.")
        staged = store is not None and not store.pinned
        return CudaTransfer(device, StagingRing(STAGING_SLOTS, store.expert_nbytes) if staged else None)
    return SimulatedLink(sim_link_gbps, sim_latency_us)
