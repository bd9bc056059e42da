"""The device expert cache: a fixed pool of slots, each holding one packed expert.

Eviction only ever picks a READY, unpinned slot (`Slot` says what each state
means), chosen by the eviction policy (pure bookkeeping in `engine.device_cache.eviction`);
this module does the memory moves and counts uses and copies per phase
(`engine.device_cache.stats`). A use is a hit when the expert is resident or
already on its way (a prefetch in flight); a miss starts an on-demand copy.

Streaming (LRU only): each MoE layer keeps a share of the slots across steps
(`kept_share`: the slots less `STREAM_DEPTH`, split evenly over the layers). That one
rule decides three things: a step that needs more of a layer's experts than its share (a
verify over several tokens, a prefill) *streams* (`streams`); a streamed miss beyond the
share loads as *transient*, evicted before anything else, so the experts every layer keeps
survive the step (`acquire`); and the LRU victim comes from a layer keeping more than its
share (`engine.device_cache.victims`). A prefetch may be limited to spare slots (`spare_only`: free
or transient ones); it then loads as transient too, and `expire_prefetches` releases those
its layer turned out not to need.

The phase a use counts in is scoped with `in_phase` (always restored).

In place (`in_place`: a CPU device with no link to simulate and a slot for every expert), the
device *is* the host memory the store lives in: an expert's slot is a view of its store row, so
nothing is copied, every use is a hit, and no second copy of the experts is ever allocated.

Thread safety: the prefetch worker thread and compute share the cache; every
table change happens under one lock. Waiting for a copy happens outside it.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch

from engine.device_cache.eviction import EvictionPolicy, ExpertKey
from engine.device_cache.fixed_slots import UnpinnedUses
from engine.device_cache.slots import NoEvictableSlot, Slot, SlotState, allocate_pool
from engine.device_cache.stats import CacheStats, PhaseCounters
from engine.device_cache.transfer import TransferEngine
from engine.device_cache.victims import can_evict, oldest_preferred, preferred_victims
from engine.store.host_store import ExpertStore

log = logging.getLogger(__name__)

STREAM_DEPTH = 2  # streamed misses pinned at once: one computing while the next is on the link


class ExpertCache(UnpinnedUses):
    def __init__(
        self,
        store: ExpertStore,
        n_slots: int,
        device: torch.device,
        transfer: TransferEngine,
        policy: EvictionPolicy,
        in_place: bool = False,
    ):
        self.store = store
        self.in_place = in_place and device.type == "cpu" and n_slots >= store.total_experts
        self.device = device
        self.transfer = transfer
        self.policy = policy
        self.expert_nbytes = store.expert_nbytes
        self._build_pool(n_slots)
        self._table: dict[ExpertKey, Slot] = {}
        self._kept: dict[int, int] = defaultdict(int)  # layer -> resident experts not transient
        self._transient: set[ExpertKey] = set()  # resident experts loaded as transient
        self._in_place: dict[int, set[int]] = defaultdict(set)  # layer -> its experts mapped in place
        self._slot_tables: dict[int, torch.Tensor] = {}  # layer -> `slot_table`, until one leaves
        self.stats = CacheStats()
        self.phase = "decode"
        self.lock = threading.RLock()

    # -- queries ----------------------------------------------------------------------------

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._table

    def resident(self) -> list[ExpertKey]:
        with self.lock:
            return list(self._table)

    @property
    def used_slots(self) -> int:
        return len(self._table)

    def kept_share(self, layer: int | None = None) -> int:
        """How many of `layer`'s experts stay cached from one step to the next: the slots less the
        `STREAM_DEPTH` that streamed misses pass through, split evenly over the MoE layers (the
        first `room % layers` of them keep one more). With no layer: the smallest share.

        Layers are visited in a cycle. Without shares, a step needing more of one layer's experts
        than that (a verify over 7.5 tokens of a 16-expert, top-2 layer needs ~10) would evict the
        experts of the layers coming next, whose turn is nearer; each layer keeping its share is
        what Mixtral-offloading's per-layer LRU groups do."""
        return self._least_share if layer is None else self._shares[layer]

    def streams(self, layer_experts: int, layer: int | None = None) -> bool:
        """Whether a step needing `layer_experts` of `layer`'s experts streams its misses: it needs
        more than the layer's kept share, and not every expert fits (LRU only: its per-layer
        groups are what this keeps)."""
        return (
            self.policy.layer_share
            and self.n_slots < self.store.total_experts
            and layer_experts > self.kept_share(layer)
        )

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Count the uses and copies inside the block in `phase`; the previous phase comes back
        however the block ends."""
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    # -- use by compute ---------------------------------------------------------------------

    def acquire(self, key: ExpertKey, streaming: bool = False) -> Slot:
        """Pin `key`'s slot for compute, starting an on-demand copy on a miss.

        `streaming` (a step that needs more of a layer's experts than it keeps, see `streams`):
        a miss is loaded as transient, evicted before anything else, once the layer holds its
        kept share. Raises NoEvictableSlot when a miss finds every slot loading or pinned.
        """
        with self.lock:
            counters = self.stats.phases[self.phase]
            slot = self._table.get(key)
            if slot is None and self.in_place:
                slot = self._map_in_place(key)
                counters.hits += 1
            elif slot is None:
                transient = streaming and not self._keeps(key[0])
                slot = self._load(key, counters, transient)
                counters.misses += 1
            else:
                # Reused before it was evicted: keep it like any other. A prefetch's first use is
                # kept only if the layer has room (it was brought in for this step alone).
                if slot.transient and (slot.prefetch_phase is None or self._keeps(key[0])):
                    slot.transient = False
                    self._transient.discard(key)
                    self._kept[key[0]] += 1
                counters.hits += 1
                if slot.prefetch_phase is not None:
                    self.stats.phases[slot.prefetch_phase].prefetch_used += 1
                    counters.prefetch_hits += 1
                    slot.prefetch_phase = None
            slot.pins += 1
            self.policy.on_access(key)
            return slot

    def count_cpu_use(self) -> None:
        """A use computed on the CPU: a miss for the device cache, with no copy."""
        with self.lock:
            self.stats.phases[self.phase].misses += 1
            self.stats.phases[self.phase].cpu_computed += 1

    def wait(self, slot: Slot) -> dict[str, torch.Tensor]:
        """Typed views of a pinned slot once its copy has landed."""
        copy = slot.copy
        if slot.state is SlotState.LOADING and copy is not None:
            try:
                copy.wait()  # outside the lock: the prefetch worker keeps going meanwhile
            except BaseException:
                with self.lock:
                    if slot.copy is copy:
                        self._unmap(slot)  # its contents are garbage: never serve it as a hit
                raise
            with self.lock:
                if slot.copy is copy:
                    slot.state = SlotState.READY
                    slot.copy = None
        return slot.views

    def release(self, slot: Slot) -> None:
        with self.lock:
            if slot.pins <= 0:
                raise RuntimeError(f"slot {slot.index} released more often than acquired")
            slot.pins -= 1
            if slot.pins == 0:
                slot.released = self.transfer.release_marker()
                if slot.state is SlotState.FREE:  # unmapped while pinned (a failed copy)
                    self._free.append(slot)

    def wait_for_a_copy(self) -> bool:
        """Block until some in-flight copy into an unpinned slot has landed (so it can be evicted).

        False when no such copy exists: every slot is pinned."""
        with self.lock:
            loading = [s for s in self.slots if s.state is SlotState.LOADING and s.pins == 0 and s.copy]
            if not loading:
                return False
            slot, copy = loading[0], loading[0].copy
        try:
            copy.synchronize()  # the host sleeps until it lands: never a spin on `done()`
        except Exception as err:  # a failed prefetch: its slot is dropped, which also makes room
            log.debug("A prefetch copy failed: %s", err)
            with self.lock:
                if slot.copy is copy and slot.pins == 0:  # still that copy's slot
                    self._unmap(slot)
                    self._free.append(slot)
        return True

    # -- background loads (prefetch) ---------------------------------------------------------

    def prefetch(self, key: ExpertKey, phase: str | None = None, spare_only: bool = False) -> bool:
        """Start bringing `key` in without using it, counted in `phase` (default: the current one).

        It takes a free slot, or evicts by the cache policy; with `spare_only`, only a free or
        transient slot (LRU streaming), and it loads as transient: the experts every layer
        keeps are never touched. That is what a prefetch may take when the cache streams:
        with so small a cache, each kept expert evicted costs verification about as many
        misses as the prefetch saves.

        False when already resident or no such slot can be evicted."""
        with self.lock:
            if key in self._table or self.in_place:
                return False
            phase = phase or self.phase
            counters = self.stats.phases[phase]
            try:
                spare = self._spare() if spare_only else None
                slot = self._load(key, counters, transient=spare_only, slot=spare)
            except NoEvictableSlot:
                return False
            slot.prefetch_phase = phase
            counters.prefetched += 1
            return True

    def streamed(self, key: ExpertKey) -> bool:
        """Whether using `key` takes a stream slot: a miss, or a transient expert already loaded."""
        with self.lock:
            slot = self._table.get(key)
            return slot is None or slot.transient

    def expire_prefetches(self, layer: int, needed: Collection[int]) -> None:
        """`layer`'s step needs the experts `needed`: its transient prefetches of others were
        mispredicted. They count as wasted, and their slots become ordinary transient ones,
        the first to be evicted (not the experts other layers keep)."""
        with self.lock:
            for (slot_layer, expert), slot in self._table.items():
                if slot.transient and slot_layer == layer and expert not in needed:
                    self._drop_prefetch(slot)

    def settle_prefetches(self) -> None:
        """Count prefetched experts still unused as wasted (the end of a run)."""
        with self.lock:
            for slot in self.slots:
                self._drop_prefetch(slot)

    # -- internals -------------------------------------------------------------------------

    def _keeps(self, layer: int) -> bool:
        """Whether a streamed miss of `layer` is kept: the layer holds less than its share."""
        return self._kept[layer] < self.kept_share(layer)

    def _load(
        self, key: ExpertKey, counters: PhaseCounters, transient: bool = False, slot: Slot | None = None
    ) -> Slot:
        if slot is None:
            slot = self._free.pop() if self._free else self._evict()
        layer, expert = key
        src = self.store.buffer(layer, expert)
        row = self.pool[slot.index]
        try:
            slot.copy = self.transfer.copy(row[: src.numel()], src, after=slot.released)
        except BaseException:
            self._free.append(slot)
            raise
        slot.view_later(self.store.layout_of(layer), row)
        slot.state = SlotState.LOADING
        slot.key, slot.transient = key, transient
        if transient:
            self._transient.add(key)
        else:
            self._kept[key[0]] += 1
        self._table[key] = slot
        self.policy.on_insert(key)
        counters.copies += 1
        counters.bytes_copied += src.numel()
        return slot

    def _evictable(self) -> dict[ExpertKey, Slot]:
        return {slot.key: slot for slot in self._table.values() if can_evict(slot)}

    def _evict(self) -> Slot:
        crowded = self._crowded() if self.policy.layer_share else None
        if self.policy.recency_ordered:
            victim = self._table[oldest_preferred(self._table, self._transient, crowded, self.policy)]
            self._unmap(victim)
            return victim
        candidates = self._evictable()
        if not candidates:
            raise NoEvictableSlot
        return self._evict_one_of(preferred_victims(candidates, crowded))

    def _crowded(self) -> set[int]:
        """The layers keeping more experts than their share (`kept_share`)."""
        return {layer for layer, kept in self._kept.items() if kept > self._shares.get(layer, 0)}

    def _evict_one_of(self, candidates: dict[ExpertKey, Slot]) -> Slot:
        victim = candidates[self.policy.victim(candidates)]
        self._unmap(victim)
        return victim

    def _spare(self) -> Slot:
        """A free slot, or an evictable transient one not holding a prefetch waiting for its use."""
        if self._free:
            return self._free.pop()
        transient = {
            k: self._table[k]
            for k in self._transient
            if can_evict(self._table[k]) and self._table[k].prefetch_phase is None
        }
        if not transient:
            raise NoEvictableSlot
        return self._evict_one_of(transient)

    def _drop_prefetch(self, slot: Slot) -> None:
        if slot.prefetch_phase is not None:
            self.stats.phases[slot.prefetch_phase].prefetch_wasted += 1
            slot.prefetch_phase = None

    def _unmap(self, slot: Slot) -> None:
        self._drop_prefetch(slot)
        self._slot_tables.pop(slot.key[0], None)
        del self._table[slot.key]
        self._transient.discard(slot.key)
        self._in_place[slot.key[0]].discard(slot.key[1])
        if not slot.transient:
            self._kept[slot.key[0]] -= 1
        self.policy.on_remove(slot.key)
        slot.key, slot.state, slot.copy, slot.transient = None, SlotState.FREE, None, False

    def clear(self) -> None:
        """Forget every resident expert (used after an error left slots in doubt)."""
        with self.lock:
            for slot in self.slots:
                if slot.copy is not None:
                    try:
                        slot.copy.synchronize()
                    except Exception as err:  # its consumer got (or would get) the error; dropped
                        log.debug("Discarding slot %d after a failed copy: %s", slot.index, err)
                if slot.key is not None:
                    self.policy.on_remove(slot.key)
                self._drop_prefetch(slot)
                slot.free()
            self._table.clear()
            self._slot_tables.clear()
            self._kept.clear()
            self._in_place.clear()
            self._transient.clear()
            self._free = list(reversed(self.slots))

    def use_policy(self, policy: EvictionPolicy) -> None:
        """Evict by `policy` from now on, starting empty as a fresh load does (auto-tune measures
        each cache policy on one loaded model)."""
        with self.lock:
            self.clear()
            self.policy = policy

    def resize(self, n_slots: int) -> None:
        """Forget every resident expert and rebuild the pool with `n_slots` slots (after the device
        ran out of memory, a smaller cache lets the same model go on)."""
        with self.lock:
            self.clear()
            self.slots, self._free, self.pool = [], [], None  # drop the old pool before allocating
            self._build_pool(n_slots)

    def _build_pool(self, n_slots: int) -> None:
        """`n_slots` slots in one pool; where the cache can miss, one more row of zeros past them
        (`zero_row`): a slot table sends an expert computed elsewhere there (the CPU's misses in
        engine.decode.piecewise_step), and the kernels add exactly nothing for it."""
        misses = n_slots < self.store.total_experts
        rows = n_slots + misses
        self.pool = None if self.in_place else allocate_pool(rows, self.expert_nbytes, self.device)
        self.zero_row = n_slots if misses and self.pool is not None else None
        if self.zero_row is not None:
            self.pool[self.zero_row].zero_()
        self.n_slots = n_slots
        layers = self.store.layer_indices
        share, extra = divmod(max(n_slots - STREAM_DEPTH, 0), max(len(layers), 1))
        self._shares = {layer: share + (i < extra) for i, layer in enumerate(layers)}
        self._least_share = share
        self.slots = [Slot(i, {}) for i in range(n_slots)]  # a slot's views come with its expert
        self._free = list(reversed(self.slots))
