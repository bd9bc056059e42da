"""The expert cache's slots: one device buffer each, the state of what it holds, and the pool.

`ExpertCache` owns the table of slots and every change to it; this module only says what
a slot is, so its states can be read (and tested) on their own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device_cache.eviction import ExpertKey
from engine.device_cache.transfer import CopyHandle
from engine.errors import DeviceOutOfMemoryError


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    """One device buffer holding one packed expert, and what the cache knows about it.

    - `state`: FREE, LOADING (`copy` says when it lands) or READY;
    - `pins`: compute's uses in progress; a pinned slot is never evicted;
    - `released`: the transfer engine's marker of compute's last use (a CUDA event): the
      next copy into the slot waits for it, so it never overwrites an expert still being read;
    - `prefetch_phase`: the phase that prefetched the expert, until its first use (then None);
    - `transient`: streamed through by a multi-token step beyond its layer's kept share;
    - `views`: the typed views of its expert's fields, made when first read (`view_later`): a step
      whose kernels read the pool row itself (the fused kernels, the graph pieces) never makes them.
    """

    index: int
    _views: dict[str, torch.Tensor]
    key: ExpertKey | None = None
    state: SlotState = SlotState.FREE
    pins: int = 0
    copy: CopyHandle | None = None
    released: object | None = None
    prefetch_phase: str | None = None
    transient: bool = False
    _make_views: Callable[[], dict[str, torch.Tensor]] | None = None

    @property
    def views(self) -> dict[str, torch.Tensor]:
        if self._make_views is not None:
            self._views, self._make_views = self._make_views(), None
        return self._views

    @views.setter
    def views(self, views: dict[str, torch.Tensor]) -> None:
        self._views, self._make_views = views, None

    def view_later(self, layout, row: torch.Tensor) -> None:
        """`views` become `layout.views(row)` when first read."""
        self._make_views = lambda: layout.views(row)

    def free(self) -> None:
        """Back to holding nothing: no expert, no copy, no pin."""
        self.key, self.state, self.copy, self.pins, self.transient = None, SlotState.FREE, None, 0, False


class NoEvictableSlot(Exception):
    """Every slot is loading or pinned: finish some work, then ask again."""


def allocate_pool(n_slots: int, expert_nbytes: int, device: torch.device) -> torch.Tensor:
    try:
        return torch.empty((n_slots, expert_nbytes), dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as err:
        raise DeviceOutOfMemoryError(
            f"Out of device memory allocating the expert cache ({n_slots} slots × "
            f"{expert_nbytes / 2**20:.1f} MiB). Lower --expert-budget."
        ) from err
