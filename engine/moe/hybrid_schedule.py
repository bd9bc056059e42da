"""Hybrid CPU/GPU execution of one MoE layer's experts (Fiddler, HybriMoE section 4.B).

Contract: pure scheduling on a measured cost model; no tensors, no clock. Given the tokens
routed to each expert of a layer (`work`) and which experts are resident on the device
(`cached`), `schedule` decides which missing experts are copied to the device and which are
computed on the CPU from host memory, and in what order, so the layer ends soonest.

Execution model (what `Plan.makespan_ms` simulates): three timelines run in parallel from 0.
The CPU computes `plan.cpu` back to back; the link copies `plan.copy` back to back, each in
`cost.load_ms`; the GPU computes `plan.gpu` in order, each expert starting when the GPU is
free and, for a copied expert, its copy has landed. The layer ends when the CPU and GPU both
have. Costs per expert depend on its token count n: `cost.gpu_ms(n)`, `cost.cpu_ms(n)`.

Modes: "never" copies every missing expert (GPU computes all); "always" computes every
missing expert on the CPU; "auto" follows HybriMoE's simulation-based scheduling:

- GPU queue: resident experts, by load descending; a copied expert joins it by load.
- CPU queue: missing experts, by load ascending; the CPU takes from the light end.
- Link: takes the heaviest missing expert, so the GPU gets the work the CPU is slowest at.
- When its queue is empty the CPU takes resident experts from the light end of the GPU queue.
- At each step the timeline whose next event is earliest acts (ties: a copy landing, then
  GPU, link, CPU).

Simplifications and guards (the paper gives the rules, not their tie-breaks): a copy is
started only when the simulation projects it to end the layer sooner than leaving the expert
to the CPU; the CPU takes a missing expert only if it finishes it before the GPU would finish
with everything left copied; it takes a resident one only if that does not delay the layer
(Fig. 5's move: the CPU computes a cached light expert while the GPU waits for a copy);
copied experts are never handed back to the CPU. Projections assume the GPU runs its queue
without idling except for copies. Cost: O(m² log m) for m active experts.

"auto" then compares the simulated plan (`simulate_hybrid`) with the "never" and "always"
plans under the same model and returns the fastest (ties: fewer copies), so it is never
slower than either under the cost model; on randomized cases the simulated plan alone already
is not. Only this layer's time is valued: that a copy also warms the cache for later steps is
left to prefetch and eviction.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

MODES: tuple[str, ...] = ("auto", "never", "always")


@dataclass(frozen=True)
class LinearCost:
    """Time of one expert over n tokens: max(0, base_ms + per_token_ms · n)."""

    base_ms: float
    per_token_ms: float

    def __call__(self, tokens: int) -> float:
        return max(0.0, self.base_ms + self.per_token_ms * tokens)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> LinearCost:
        """Least-squares line through measured (tokens, ms) samples.

        One distinct token count, or a fitted slope below zero (noise: time never falls with
        more tokens), gives the best constant, the mean.
        """
        if not samples:
            raise ValueError("need at least one (tokens, ms) sample to fit a cost")
        for tokens, ms in samples:
            if tokens < 0 or not (math.isfinite(ms) and ms >= 0):
                raise ValueError(f"samples must be (tokens >= 0, finite ms >= 0), got {(tokens, ms)}")
        mean_n = sum(n for n, _ in samples) / len(samples)
        mean_ms = sum(ms for _, ms in samples) / len(samples)
        spread = sum((n - mean_n) ** 2 for n, _ in samples)
        if spread == 0:
            return cls(mean_ms, 0.0)
        slope = sum((n - mean_n) * (ms - mean_ms) for n, ms in samples) / spread
        if slope < 0:
            return cls(mean_ms, 0.0)
        return cls(mean_ms - slope * mean_n, slope)


@dataclass(frozen=True)
class CostModel:
    """Measured per-expert costs: compute on either side as a function of tokens, one copy."""

    gpu: LinearCost
    cpu: LinearCost
    load_ms: float  # copy of one expert host -> device

    def __post_init__(self) -> None:
        if not (math.isfinite(self.load_ms) and self.load_ms >= 0):
            raise ValueError(f"load_ms must be a finite number >= 0, got {self.load_ms}")

    def gpu_ms(self, tokens: int) -> float:
        return self.gpu(tokens)

    def cpu_ms(self, tokens: int) -> float:
        return self.cpu(tokens)

    @classmethod
    def from_samples(
        cls, gpu: Sequence[tuple[int, float]], cpu: Sequence[tuple[int, float]], load_ms: float
    ) -> CostModel:
        """Fit both compute lines from (tokens, ms) measurements."""
        return cls(LinearCost.fit(gpu), LinearCost.fit(cpu), load_ms)


@dataclass(frozen=True)
class Plan:
    """How one layer's experts run; see the module docstring for the execution model."""

    cpu: list[int]  # experts computed on the CPU, in order
    copy: list[int]  # missing experts copied to the device, in order
    gpu: list[int]  # experts computed on the GPU, in order (resident and copied)
    makespan_ms: float  # simulated time until both CPU and GPU are done


def cpu_is_faster(tokens: int, cost: CostModel) -> bool:
    """Fiddler's rule for one missing expert: compute on the CPU when that beats copy + GPU."""
    return cost.cpu_ms(tokens) < cost.load_ms + cost.gpu_ms(tokens)


def schedule(work: Mapping[int, int], cached: set[int], cost: CostModel, mode: str = "auto") -> Plan:
    """Plan one layer: `work` maps expert id -> tokens routed to it; `cached` are resident."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    loads = _loads(work)
    if mode == "never":
        return _copy_all(loads, cached, cost)
    if mode == "always":
        return _cpu_all(loads, cached, cost)
    candidates = [
        _HybridSimulation(loads, cached, cost).run(),
        _cpu_all(loads, cached, cost),
        _copy_all(loads, cached, cost),
    ]
    return min(candidates, key=lambda plan: (plan.makespan_ms, len(plan.copy)))


def simulate_hybrid(work: Mapping[int, int], cached: set[int], cost: CostModel) -> Plan:
    """The plan HybriMoE's simulation alone builds, before "auto" compares it with the pure plans."""
    return _HybridSimulation(_loads(work), cached, cost).run()


def _loads(work: Mapping[int, int]) -> dict[int, int]:
    """Validated tokens per expert, without the experts no token was routed to."""
    for expert, tokens in work.items():
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"expert {expert}: tokens must be an integer >= 0, got {tokens!r}")
    return {expert: tokens for expert, tokens in work.items() if tokens > 0}


def _heavy_first(loads: Mapping[int, int], experts: Sequence[int] | set[int]) -> list[int]:
    return sorted(experts, key=lambda expert: (-loads[expert], expert))


def _light_first(loads: Mapping[int, int], experts: Sequence[int] | set[int]) -> list[int]:
    return sorted(experts, key=lambda expert: (loads[expert], expert))


def _copy_all(loads: Mapping[int, int], cached: set[int], cost: CostModel) -> Plan:
    resident = _heavy_first(loads, [e for e in loads if e in cached])
    copy = _heavy_first(loads, [e for e in loads if e not in cached])
    return _plan([], copy, resident + copy, loads, cost)


def _cpu_all(loads: Mapping[int, int], cached: set[int], cost: CostModel) -> Plan:
    resident = _heavy_first(loads, [e for e in loads if e in cached])
    missing = _light_first(loads, [e for e in loads if e not in cached])
    return _plan(missing, [], resident, loads, cost)


def _plan(cpu: list[int], copy: list[int], gpu: list[int], loads: Mapping[int, int], cost: CostModel) -> Plan:
    """A plan with its makespan under the execution model of the module docstring."""
    cpu_end = sum(cost.cpu_ms(loads[expert]) for expert in cpu)
    landed: dict[int, float] = {}
    for position, expert in enumerate(copy, start=1):
        landed[expert] = position * cost.load_ms
    gpu_end = 0.0
    for expert in gpu:
        gpu_end = max(gpu_end, landed.get(expert, 0.0)) + cost.gpu_ms(loads[expert])
    return Plan(cpu, copy, gpu, max(cpu_end, gpu_end))


class _HybridSimulation:
    """HybriMoE's event-driven simulation of one layer; `run` returns the plan it builds."""

    def __init__(self, loads: Mapping[int, int], cached: set[int], cost: CostModel) -> None:
        self.loads, self.cost = loads, cost
        self.resident = {expert for expert in loads if expert in cached}
        self.gpu_queue = _heavy_first(loads, self.resident)  # ready on the device
        self.cpu_queue = deque(_light_first(loads, [e for e in loads if e not in cached]))
        self.in_flight: deque[tuple[float, int]] = deque()  # (lands at, expert), in order
        self.now = self.cpu_free = self.gpu_free = self.link_free = 0.0
        self.cpu_order: list[int] = []
        self.copy_order: list[int] = []
        self.gpu_order: list[int] = []

    def run(self) -> Plan:
        while self.cpu_queue or self.gpu_queue or self.in_flight:
            events = self._events()
            if not events:
                # Only float rounding gets here: a copy is declined only when the CPU would
                # finish sooner, which makes the CPU's guard accept. Keep the loop live.
                events = [(max(self.cpu_free, self.now), 3, self._cpu_take)]
            self.now, _, act = min(events, key=lambda event: event[:2])
            act()
        return _plan(self.cpu_order, self.copy_order, self.gpu_order, self.loads, self.cost)

    def _events(self) -> list[tuple[float, int, Callable[[], None]]]:
        """(start time, tie priority, action) of every timeline that can act next."""
        events: list[tuple[float, int, Callable[[], None]]] = []
        if self.in_flight:
            events.append((self.in_flight[0][0], 0, self._land))
        if self.gpu_queue:
            events.append((max(self.gpu_free, self.now), 1, self._gpu_take))
        link_start = max(self.link_free, self.now)
        if self.cpu_queue and self._copy_pays(self.cpu_queue[-1], link_start):
            events.append((link_start, 2, self._copy))
        cpu_start = max(self.cpu_free, self.now)
        if self.cpu_queue and self._cpu_keeps(self.cpu_queue[0], cpu_start):
            events.append((cpu_start, 3, self._cpu_take))
        elif not self.cpu_queue and self._steal_candidate(cpu_start) is not None:
            events.append((cpu_start, 3, self._cpu_steal))
        return events

    # -- actions ----------------------------------------------------------------------------

    def _land(self) -> None:
        _, expert = self.in_flight.popleft()
        bisect.insort(self.gpu_queue, expert, key=lambda e: (-self.loads[e], e))

    def _gpu_take(self) -> None:
        expert = self.gpu_queue.pop(0)
        self.gpu_free = self.now + self.cost.gpu_ms(self.loads[expert])
        self.gpu_order.append(expert)

    def _copy(self) -> None:
        expert = self.cpu_queue.pop()
        self.link_free = self.now + self.cost.load_ms
        self.in_flight.append((self.link_free, expert))
        self.copy_order.append(expert)

    def _cpu_take(self) -> None:
        self._cpu_run(self.cpu_queue.popleft())

    def _cpu_steal(self) -> None:
        expert = self._steal_candidate(self.now)
        assert expert is not None  # chosen as an event only when there is one
        self.gpu_queue.remove(expert)
        self._cpu_run(expert)

    def _cpu_run(self, expert: int) -> None:
        self.cpu_free = self.now + self.cost.cpu_ms(self.loads[expert])
        self.cpu_order.append(expert)

    # -- projections and guards -------------------------------------------------------------

    def _gpu_end(self, arrivals: Sequence[tuple[float, int]] = (), without: int | None = None) -> float:
        """When the GPU would finish its queue, the copies in flight and extra `arrivals`."""
        end = max(self.gpu_free, self.now)
        end += sum(self.cost.gpu_ms(self.loads[e]) for e in self.gpu_queue if e != without)
        for lands, expert in sorted([*self.in_flight, *arrivals]):
            end = max(end, lands) + self.cost.gpu_ms(self.loads[expert])
        return end

    def _cpu_end(self) -> float:
        """When the CPU would finish if it computed every missing expert still queued."""
        queued = sum(self.cost.cpu_ms(self.loads[e]) for e in self.cpu_queue)
        return max(self.cpu_free, self.now) + queued

    def _copy_pays(self, expert: int, start: float) -> bool:
        """Copying `expert` (the heaviest queued) is projected to end the layer sooner."""
        cpu_end = self._cpu_end()
        keep = max(cpu_end, self._gpu_end())
        lands = start + self.cost.load_ms
        move = max(cpu_end - self.cost.cpu_ms(self.loads[expert]), self._gpu_end([(lands, expert)]))
        return move < keep

    def _cpu_keeps(self, expert: int, start: float) -> bool:
        """The CPU finishes `expert` no later than the GPU would with all queued experts copied."""
        link_start = max(self.link_free, self.now)
        heaviest_first = reversed(self.cpu_queue)
        arrivals = [(link_start + i * self.cost.load_ms, e) for i, e in enumerate(heaviest_first, start=1)]
        return start + self.cost.cpu_ms(self.loads[expert]) <= self._gpu_end(arrivals)

    def _steal_candidate(self, start: float) -> int | None:
        """The lightest resident expert in the GPU queue, if the CPU taking it delays nothing."""
        resident = [expert for expert in self.gpu_queue if expert in self.resident]
        if not resident:
            return None
        expert = resident[-1]
        on_cpu_end = start + self.cost.cpu_ms(self.loads[expert])
        if max(on_cpu_end, self._gpu_end(without=expert)) <= self._gpu_end():
            return expert
        return None
