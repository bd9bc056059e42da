"""The device expert cache: a fixed pool of slots, each holding one packed expert.

Slot states: FREE (empty), LOADING (a copy is in flight; its handle says when it
lands), READY (resident). Independently, a slot is *pinned* while compute uses
it. Eviction only ever picks READY, unpinned slots, chosen by the eviction
policy (pure bookkeeping in `engine.eviction`); this module does the memory
moves and counts hits, misses and bytes per phase.

A use is a hit when the expert is resident or already on its way (a prefetch in
flight); a miss starts an on-demand copy.
"""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from engine.errors import DeviceOutOfMemoryError
from engine.eviction import EvictionPolicy, ExpertKey
from engine.expert_store import ExpertStore
from engine.transfer import CopyHandle, TransferEngine

log = logging.getLogger(__name__)

PHASES = ("prefill", "decode", "draft", "verify")


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    index: int
    views: dict[str, torch.Tensor]
    key: ExpertKey | None = None
    state: SlotState = SlotState.FREE
    pins: int = 0
    copy: CopyHandle | None = None
    released: object | None = None  # marker of compute's last use; a new copy waits for it


@dataclass
class PhaseCounters:
    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    copies: int = 0

    @property
    def uses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.uses if self.uses else None


@dataclass
class CacheStats:
    phases: dict[str, PhaseCounters] = field(default_factory=lambda: defaultdict(PhaseCounters))

    def total(self) -> PhaseCounters:
        total = PhaseCounters()
        for counters in self.phases.values():
            total.hits += counters.hits
            total.misses += counters.misses
            total.bytes_copied += counters.bytes_copied
            total.copies += counters.copies
        return total


class NoEvictableSlot(Exception):
    """Every slot is loading or pinned: finish some work, then ask again."""


class ExpertCache:
    def __init__(
        self,
        store: ExpertStore,
        n_slots: int,
        device: torch.device,
        transfer: TransferEngine,
        policy: EvictionPolicy,
    ):
        self.store = store
        self.device = device
        self.transfer = transfer
        self.policy = policy
        self.n_slots = n_slots
        self.expert_nbytes = store.layout.nbytes
        self.pool = _allocate_pool(n_slots, self.expert_nbytes, device)
        self.slots = [Slot(i, store.layout.views(self.pool[i])) for i in range(n_slots)]
        self._free = list(reversed(self.slots))
        self._table: dict[ExpertKey, Slot] = {}
        self.stats = CacheStats()
        self.phase = "decode"

    # -- queries ----------------------------------------------------------------------------

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._table

    def resident(self) -> list[ExpertKey]:
        return list(self._table)

    @property
    def used_slots(self) -> int:
        return len(self._table)

    # -- use by compute ---------------------------------------------------------------------

    def acquire(self, key: ExpertKey) -> Slot:
        """Pin `key`'s slot for compute, starting an on-demand copy on a miss.

        Raises NoEvictableSlot when a miss finds every slot loading or pinned.
        """
        counters = self.stats.phases[self.phase]
        slot = self._table.get(key)
        if slot is None:
            slot = self._load(key, counters)
            counters.misses += 1
        else:
            counters.hits += 1
        slot.pins += 1
        self.policy.on_access(key)
        return slot

    def wait(self, slot: Slot) -> dict[str, torch.Tensor]:
        """Typed views of a pinned slot once its copy has landed."""
        if slot.state is SlotState.LOADING:
            try:
                slot.copy.wait()
            except BaseException:
                self._unmap(slot)  # its contents are garbage: never serve it as a hit
                raise
            slot.state = SlotState.READY
            slot.copy = None
        return slot.views

    def release(self, slot: Slot) -> None:
        if slot.pins <= 0:
            raise RuntimeError(f"slot {slot.index} released more often than acquired")
        slot.pins -= 1
        if slot.pins == 0:
            slot.released = self.transfer.release_marker()
            if slot.state is SlotState.FREE:  # unmapped while pinned (a failed copy)
                self._free.append(slot)

    # -- background loads (prefetch) ---------------------------------------------------------

    def prefetch(self, key: ExpertKey) -> bool:
        """Start bringing `key` in without using it; False when already resident or nothing can be evicted."""
        if key in self._table:
            return False
        try:
            self._load(key, self.stats.phases[self.phase])
        except NoEvictableSlot:
            return False
        return True

    # -- internals -------------------------------------------------------------------------

    def _load(self, key: ExpertKey, counters: PhaseCounters) -> Slot:
        slot = self._free.pop() if self._free else self._evict()
        layer, expert = key
        src = self.store.buffer(layer, expert)
        try:
            slot.copy = self.transfer.copy(self.pool[slot.index], src, after=slot.released)
        except BaseException:
            self._free.append(slot)
            raise
        slot.state = SlotState.LOADING
        slot.key = key
        self._table[key] = slot
        self.policy.on_insert(key)
        counters.copies += 1
        counters.bytes_copied += self.expert_nbytes
        return slot

    def _evict(self) -> Slot:
        candidates = {
            slot.key: slot
            for slot in self._table.values()
            if slot.pins == 0 and (slot.state is SlotState.READY or slot.copy.done())
        }
        if not candidates:
            raise NoEvictableSlot
        victim = candidates[self.policy.victim(candidates)]
        self._unmap(victim)
        return victim

    def _unmap(self, slot: Slot) -> None:
        del self._table[slot.key]
        self.policy.on_remove(slot.key)
        slot.key, slot.state, slot.copy = None, SlotState.FREE, None

    def clear(self) -> None:
        """Forget every resident expert (used after an error left slots in doubt)."""
        for slot in self.slots:
            if slot.copy is not None:
                try:
                    slot.copy.wait()
                except Exception as err:  # its consumer got (or would get) the error; the slot is dropped
                    log.debug("Discarding slot %d after a failed copy: %s", slot.index, err)
            if slot.key is not None:
                self.policy.on_remove(slot.key)
            slot.key, slot.state, slot.copy, slot.pins = None, SlotState.FREE, None, 0
        self._table.clear()
        self._free = list(reversed(self.slots))


def _allocate_pool(n_slots: int, expert_nbytes: int, device: torch.device) -> torch.Tensor:
    try:
        return torch.empty((n_slots, expert_nbytes), dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as err:
        raise DeviceOutOfMemoryError(
            f"Out of device memory allocating the expert cache ({n_slots} slots × "
            f"{expert_nbytes / 2**20:.1f} MiB). Lower --expert-budget."
        ) from err
