"""What a run installs on every MoE layer of a model: observers, a draft's routing, CPU misses.

`ExpertControl` is the one object every layer of a model shares (built by the loader); a run
changes it only through `installed`, which restores the previous values however the run ends.
`DraftRouting` says how layers route while the target drafts for itself (SS-MoE's top-r,
optionally from cached experts only, or SubSpec's resident low-bit substitutes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.moe.cuda_graphs import ExpertGraphs
from engine.store.host_store import ExpertStore

LayerObserver = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, hidden [T, H], top-k [T, K])


@dataclass(frozen=True)
class DraftRouting:
    """How MoE layers route while drafting with the target itself."""

    top_r: int | None = None  # SS-MoE: each token uses its top-r experts (r < k), weights rescaled
    cached_only: bool = False  # zero-I/O drafting: only experts already on the device
    substitute: ExpertStore | None = None  # SubSpec: device-resident low-bit copies of every expert

    @property
    def in_graph(self) -> bool:
        """Whether a captured step can hold this routing: the top-r cut is computed on the device;
        cached-only picks and substitutes are the host's."""
        return self.top_r is not None and not self.cached_only and self.substitute is None


@dataclass
class ExpertControl:
    """What a run installs on every MoE layer of one model; the loader builds one per model and
    hands the same object to each `OffloadedExperts`."""

    observers: tuple[LayerObserver, ...] = ()
    draft: DraftRouting | None = None
    hybrid: object | None = None  # engine.moe.cpu_misses.HybridExecutor: misses computed on the CPU
    # (layer, hidden [T, H]) -> the next MoE layer's likely experts, best first: a streaming step
    # copies the first `STREAM_DEPTH` of them once its own misses are issued (SP-MoE's policy).
    lookahead: Callable[[int, torch.Tensor], list[tuple[int, int]]] | None = None
    # experts of a few-token step computed in groups (`engine.moe.batched_experts`); None: on CUDA
    grouped: bool | None = None
    # one-token steps over a cache holding every expert, replayed as CUDA graphs (opt-in)
    graphs: ExpertGraphs | None = None
    # those steps through the fused kernels (`engine.moe.fused_experts`) where they apply; None: on
    # CUDA; True: on the CPU too, through Triton's interpreter (tests, counting); False: in torch.
    # Read once per layer, at its first such step.
    fused: bool | None = None
    # whether the layers count the hits of steps through a slot table: False while a whole step is
    # captured as a CUDA graph, whose replays count them after (engine.decode.captured_step)
    counts_hits: bool = True
    # a step run as a captured CUDA graph (its warm-up, capture and replays): every layer's experts
    # through a slot table, whatever the step's token count (engine.decode.captured_step)
    graphed: bool = False
    # a step run as CUDA graph pieces over a cache that can miss: its layers' experts from the
    # pieces' slot tables, brought in by the host between pieces, which also calls the observers
    # (engine.decode.piecewise_step)
    pieces: object | None = None

    @contextmanager
    def installed(self, **changes) -> Iterator[ExpertControl]:
        """Set the named fields for the block; their previous values come back however it ends."""
        previous = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in previous.items():
                setattr(self, name, value)
