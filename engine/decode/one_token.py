"""A decode step's one graph run again without working its inputs out again (`--kernels ggml`).

Contract: `OneTokenStep.of(whole, rotary, ran)`, where `ran` is the one-token step that
`WholeStep.of_ids` (engine.decode.whole_step) last ran with `reuse` (`graph_chain.Ran`), holds
that step's kept graph and cache buffers, and where each of its moving memories lies as a line in
one value: the token id's index row in the token id, the rotary angles, the cache row the new
keys go to and the mask in the position, the outputs nowhere. Each line is taken from the inputs
as the slow step makes them (`WholeStep.token`, `rotary.at`, `graph_chain.new_positions`) at two
values and checked against the memories `ran` read; None where one is not such a line.

`step(token, rotary, kv_cache)` is then the logits `[V]` of the next one-token step, in the buffer
`of_ids` reuses: the same graph on the same memories `of_ids` would give it, so the same values
bit for bit, with the cache positions written and the routes recorded as it does — or None where
`of_ids` would not run that graph so: a token outside the table, the rotary module or the head
hooked, the cache offloading or another one, or any layer's `AttentionEnds.room` not the buffers
of the step prepared on (another cache, one past its room or the graph's attention limit, a MoE
block `RoutedMlp.takes` refuses now). The caller then goes `of_ids`' way.

Why: a small model's decode step spent a large share of its Python working out again what was the
same step after step (the graph's key and lookup, its inputs' rows, its outputs' buffers), with the
caches cold from the step's weights.
"""

from __future__ import annotations

import torch

from engine.decode.graph_chain import STEP, Ran, new_positions
from engine.decode.moe_graph import one_cache, record_routes, record_shared
from engine.ggml import kernels as ggml_kernels

_TOKEN, _POSITION = 0, 1  # the value a moving memory's address follows


class OneTokenStep:
    def __init__(self, whole, ran: Ran, lines: list[tuple[int, int, int]], positions: int):
        self.ends, self.head, self.vocabulary = whole.ends, whole.head, whole.embedding.rows
        self.blocks = tuple(end.moe for end in whole.ends)
        self.shared = one_cache(self.blocks)  # their expert cache and trace, set at load
        self.graph, self.rooms, self.read_routes = ran.graph, ran.rooms, ran.read_routes
        self.lines = lines  # (start, step, value followed) a memory: at start + step × value
        self.positions = positions  # of the rotary table the angles lie in
        *_, self.router_logits, out = ran.memories
        self.logits = out[0]  # [V]: the step's one row

    @classmethod
    def of(cls, whole, rotary, ran: Ran | None) -> OneTokenStep | None:
        capacity, heads = ran.capacity if ran else 0, whole.ends[0].kv_heads
        if capacity < 2 or whole.embedding.rows < 2 or not rotary.tabled():  # two values of each line
            return None  # (and the rotary module is not called: a hook on it would see it)
        at = [_inputs(whole, rotary, value, capacity, heads) for value in (0, 1)]
        if at[0] is None or at[1] is None:
            return None
        lines = []
        for index, memory in enumerate(ran.memories):
            address = memory.data_ptr()
            if index >= len(at[0]):  # an output, or the routes: the same buffers step after step
                lines.append((address, 0, _TOKEN))
                continue
            start = at[0][index].data_ptr()
            step, follows = at[1][index].data_ptr() - start, _TOKEN if index == 0 else _POSITION
            if not step or not _through(address, start, step, follows, ran.length):
                return None  # not a line through the memory the step read
            lines.append((start, step, follows))
        return cls(whole, ran, lines, at[0][1].table.shape[1])  # [1, positions, D] angles

    def step(self, token: int, rotary, kv_cache) -> torch.Tensor | None:
        """The logits `[V]` of `token` after `kv_cache`'s positions, or None (see the module)."""
        caches = kv_cache.layers
        if not 0 <= token < self.vocabulary or len(caches) != len(self.ends):
            return None
        if not rotary.tabled() or self.head.hooked() or getattr(kv_cache, "offloading", False):
            return None
        position = caches[0].get_seq_length()
        if position >= self.positions:
            return None
        for end, cache, (keys, values) in zip(self.ends, caches, self.rooms, strict=True):
            room = end.room(cache, 1)
            if room is None or room[0] is not keys() or room[1] is not values():
                return None
            if cache.get_seq_length() != position:
                return None
        values = (token, position)
        addresses = [start + step * values[follows] for start, step, follows in self.lines]
        ggml_kernels.compute_again(self.graph, addresses, STEP)
        for cache in caches:
            cache.written(1)
        if self.shared is not None:
            record_shared(self.shared, self.read_routes(), self.router_logits, 1)
        else:
            record_routes(self.blocks, self.read_routes(), self.router_logits, 1)
        return self.logits


def _inputs(whole, rotary, value: int, capacity: int, heads: int) -> tuple | None:
    """A one-token step's inputs (the graph's moving order) for token id and position `value`, as
    the slow step makes them; None where one is not a table's row."""
    ids, angles = whole.token(value), rotary.at(value, 1)
    if ids is None or not all(hasattr(angle, "table") for angle in angles):
        return None
    return (ids, *angles, *new_positions(value, 1, capacity, heads))


def _through(address: int, start: int, step: int, follows: int, length: int) -> bool:
    """Whether the line passes through the memory a step read: a token's row, or the one of the
    position after the `length` cached."""
    return (address - start) % step == 0 if follows == _TOKEN else address == start + step * length
