"""Experts used without pinning a slot: where none can ever be evicted (part of `ExpertCache`).

Two caches never evict. In place (a CPU device with a slot for every expert), a slot is a view of
the expert's store row (`use_in_place`). A device cache that `holds_all` (a slot for every expert:
a 24 GB card and a Q4 30B-A3B model) is `fill`ed when the model loads, a layer at a time — copied
whole, as llama.cpp loads a model that fits — and from then on each layer's experts sit in fixed
slots, which `slot_table` gives as one device tensor: a one-token step looks its experts up in it on
the device (`engine.moe.batched_experts.forward_resident`), so the host never reads the routing, and
every use is a hit (`count_hits`). A slot table lasts until an expert of its layer leaves (a failed
copy, `clear`, `resize`).

`UnpinnedUses` is a mixin of `ExpertCache`, whose lock, counters, table and pool it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import torch

from engine.device_cache.eviction import ExpertKey
from engine.device_cache.slots import Slot, SlotState


class UnpinnedUses:
    def use_in_place(self, uses: Iterable[tuple[int, Collection[int]]]) -> None:
        """Each (layer, distinct experts) of `uses` used where they lie in an in-place store, without
        pinning a slot (none is ever evicted or reused there): hits, as `acquire` counts them."""
        if not self.in_place:
            raise RuntimeError("use_in_place needs an in-place cache (every expert in host memory)")
        with self.lock:  # once for a step's layers
            counters = self.stats.phases[self.phase]
            for layer, experts in uses:
                mapped = self._in_place[layer]
                if not mapped.issuperset(experts):  # one set operation a layer, where most are mapped
                    for expert in experts:
                        if expert not in mapped:
                            self._map_in_place((layer, expert))
                counters.hits += len(experts)

    def _map_in_place(self, key: ExpertKey) -> Slot:
        """The slot of `key` in place: views of its store row, ready at once, never evicted."""
        slot = self._free.pop()
        slot.views = self.store.views(*key)
        slot.key, slot.state = key, SlotState.READY
        self._kept[key[0]] += 1
        self._in_place[key[0]].add(key[1])
        self._table[key] = slot
        self.policy.on_insert(key)
        return slot

    @property
    def holds_all(self) -> bool:
        """A device slot for every expert (not in place): once in, none is ever evicted."""
        return self.pool is not None and self.n_slots >= self.store.total_experts

    def fill(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Every expert not yet cached brought in, when the cache `holds_all`, a layer at a time:
        copies counted in the `load` phase, each layer's on the link at once, `progress(layers
        landed, layers)` after each. Returns how many experts were copied."""
        if not self.holds_all:
            return 0
        layers, copied = self.store.layer_indices, 0
        for done, layer in enumerate(layers, 1):
            keys = [(layer, e) for e in range(self.store.num_experts) if (layer, e) not in self]
            copied += len(keys)
            self._bring_in(keys)
            if progress is not None:
                progress(done, len(layers))
        return copied

    def _bring_in(self, keys: list[ExpertKey]) -> None:
        """`keys` acquired (copies issued), waited for until the last has landed, released."""
        slots: list[Slot] = []
        try:
            with self.in_phase("load"):
                for key in keys:
                    slots.append(self.acquire(key))
            last = slots[-1].copy if slots else None
            for slot in slots:
                self.wait(slot)
            if last is not None:
                last.synchronize()  # one link, copies land in order: the layer is in
        finally:
            for slot in slots:
                self.release(slot)

    def slot_table(self, layer: int) -> torch.Tensor | None:
        """`[E]` on the device: the slot of each of `layer`'s experts, when the cache `holds_all`
        and every one of them has landed; None otherwise."""
        table = self._slot_tables.get(layer)
        if table is not None or not self.holds_all:
            return table
        with self.lock:
            slots = [self._table.get((layer, e)) for e in range(self.store.num_experts)]
            if all(slot is not None and slot.state is SlotState.READY for slot in slots):
                table = torch.tensor([slot.index for slot in slots], device=self.device)
                self._slot_tables[layer] = table
            return table

    def count_hits(self, uses: int) -> None:
        """`uses` experts read through a `slot_table`: hits, no slot pinned."""
        with self.lock:
            self.stats.phases[self.phase].hits += uses
