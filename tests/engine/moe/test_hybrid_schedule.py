"""Hybrid CPU/GPU scheduling: the extremes, HybriMoE's Fig. 5 example, and a randomized property."""

import random

import pytest

from engine.moe.hybrid_schedule import (
    MODES,
    CostModel,
    LinearCost,
    Plan,
    cpu_is_faster,
    schedule,
    simulate_hybrid,
)

# HybriMoE Fig. 5's assumptions: GPU time constant, CPU time proportional to load, copy 3 units.
FIG5_COST = CostModel(gpu=LinearCost(1.0, 0.0), cpu=LinearCost(0.0, 1.0), load_ms=3.0)


def _execute(plan: Plan, work: dict[int, int], cached: set[int], cost: CostModel) -> float:
    """Check `plan` covers the work once each, then time it: CPU, link and GPU in parallel."""
    active = {expert for expert, tokens in work.items() if tokens > 0}
    assert sorted(plan.cpu + plan.gpu) == sorted(active), "each active expert runs exactly once"
    assert set(plan.copy) == {expert for expert in plan.gpu if expert not in cached}
    assert len(plan.copy) == len(set(plan.copy))
    landed = {expert: cost.load_ms * (i + 1) for i, expert in enumerate(plan.copy)}
    gpu_end = 0.0
    for expert in plan.gpu:
        gpu_end = max(gpu_end, landed.get(expert, 0.0)) + cost.gpu_ms(work[expert])
    return max(sum(cost.cpu_ms(work[expert]) for expert in plan.cpu), gpu_end)


def _random_case(rng: random.Random) -> tuple[dict[int, int], set[int], CostModel]:
    experts = rng.randint(1, 24)
    work = {e: rng.choice([0, 1, 1, 2, 3, rng.randint(1, 8), rng.randint(1, 128)]) for e in range(experts)}
    cached = {e for e in range(experts) if rng.random() < 0.5}
    cost = CostModel(
        gpu=LinearCost(rng.uniform(0.05, 2.0), rng.uniform(0.0, 0.1)),
        cpu=LinearCost(rng.uniform(0.0, 2.0), rng.uniform(0.05, 3.0)),
        load_ms=rng.uniform(0.2, 15.0),
    )
    return work, cached, cost


# -- cost model ------------------------------------------------------------------------------


def test_linear_fit_recovers_a_line() -> None:
    fit = LinearCost.fit([(1, 3.0), (2, 5.0), (4, 9.0), (8, 17.0)])
    assert fit.base_ms == pytest.approx(1.0)
    assert fit.per_token_ms == pytest.approx(2.0)
    assert fit(10) == pytest.approx(21.0)


def test_linear_fit_degenerate_samples_give_a_constant() -> None:
    assert LinearCost.fit([(4, 2.0), (4, 4.0)]) == LinearCost(3.0, 0.0)
    assert LinearCost.fit([(1, 5.0), (2, 4.0), (3, 3.0)]) == LinearCost(4.0, 0.0)  # noise, not a speed-up
    with pytest.raises(ValueError, match="at least one"):
        LinearCost.fit([])
    with pytest.raises(ValueError, match="finite ms >= 0"):
        LinearCost.fit([(1, -2.0)])


def test_cost_model_from_samples() -> None:
    cost = CostModel.from_samples(gpu=[(1, 0.5), (64, 0.5)], cpu=[(1, 2.0), (3, 6.0)], load_ms=4.0)
    assert cost.gpu_ms(32) == pytest.approx(0.5)
    assert cost.cpu_ms(2) == pytest.approx(4.0)
    assert cost.load_ms == 4.0


def test_cpu_is_faster_is_fiddlers_rule() -> None:
    # CPU 1 ms/token against a 3 ms copy plus 1 ms of GPU: the CPU wins below 4 tokens.
    assert cpu_is_faster(3, FIG5_COST)
    assert not cpu_is_faster(4, FIG5_COST)
    assert not cpu_is_faster(10, FIG5_COST)


# -- the extremes and the fixed modes --------------------------------------------------------


WORK = {0: 6, 1: 1, 2: 12, 3: 3, 4: 2, 5: 40}
CACHED = {0, 3}
MISSING = {1, 2, 4, 5}


def test_very_slow_transfers_send_every_missing_expert_to_the_cpu() -> None:
    cost = CostModel(LinearCost(0.1, 0.01), LinearCost(0.5, 0.2), load_ms=1_000.0)
    plan = schedule(WORK, CACHED, cost)
    assert plan.copy == []
    assert set(plan.cpu) >= MISSING


def test_very_slow_cpu_copies_every_missing_expert() -> None:
    cost = CostModel(LinearCost(0.1, 0.01), LinearCost(500.0, 50.0), load_ms=2.0)
    plan = schedule(WORK, CACHED, cost)
    assert plan.cpu == []
    assert set(plan.copy) == MISSING
    assert plan.copy == [5, 2, 4, 1]  # the heaviest first (HybriMoE's transfer priority)


def test_never_copies_everything_and_always_computes_missing_on_the_cpu() -> None:
    never = schedule(WORK, CACHED, FIG5_COST, "never")
    assert never.cpu == [] and set(never.copy) == MISSING
    assert never.gpu[:2] == [0, 3]  # resident experts first, heaviest first
    always = schedule(WORK, CACHED, FIG5_COST, "always")
    assert always.copy == [] and set(always.cpu) == MISSING
    assert always.gpu == [0, 3]


def test_zero_token_experts_and_empty_layers() -> None:
    plan = schedule({0: 0, 1: 2}, {1}, FIG5_COST)
    assert plan == Plan([], [], [1], 1.0)
    assert schedule({}, set(), FIG5_COST) == Plan([], [], [], 0.0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode must be one of auto, never, always"):
        schedule(WORK, CACHED, FIG5_COST, "sometimes")
    with pytest.raises(ValueError, match="expert 3: tokens must be an integer >= 0"):
        schedule({3: -1}, set(), FIG5_COST)


# -- HybriMoE Fig. 5 ------------------------------------------------------------------------


def test_fig5_cpu_computes_a_cached_light_expert_while_the_gpu_takes_an_uncached_one() -> None:
    a, b, c, d, e = range(5)
    work = {a: 4, b: 4, c: 4, d: 1, e: 1}
    cached = {a, b, e}
    # never: GPU a, b, e by t=3, then c (lands at 3) and d (lands at 6): 7.
    # always: CPU d then c: 5.  HybriMoE: copy c while the GPU runs a, b; the CPU runs d, then
    # the cached e, which would otherwise queue on the GPU; c lands at 3 and ends at 4.
    plan = schedule(work, cached, FIG5_COST)
    assert plan == Plan(cpu=[d, e], copy=[c], gpu=[a, b, c], makespan_ms=4.0)
    assert simulate_hybrid(work, cached, FIG5_COST) == plan
    assert schedule(work, cached, FIG5_COST, "never").makespan_ms == 7.0
    assert schedule(work, cached, FIG5_COST, "always").makespan_ms == 5.0


# -- randomized property ---------------------------------------------------------------------


def test_auto_is_never_slower_than_never_or_always() -> None:
    rng = random.Random(2024)
    strictly_faster = 0
    for _ in range(200):
        work, cached, cost = _random_case(rng)
        simulated = simulate_hybrid(work, cached, cost)
        auto = schedule(work, cached, cost)
        pure = {mode: schedule(work, cached, cost, mode) for mode in ("never", "always")}
        for plan in (simulated, auto, *pure.values()):
            assert plan.makespan_ms == pytest.approx(_execute(plan, work, cached, cost))
        fastest_pure = min(plan.makespan_ms for plan in pure.values())
        assert simulated.makespan_ms <= fastest_pure + 1e-9  # the simulation alone, not the fallback
        assert auto.makespan_ms <= fastest_pure + 1e-9
        strictly_faster += auto.makespan_ms < fastest_pure - 1e-9
    assert strictly_faster > 100  # mixing CPU and GPU usually pays


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_a_valid_plan_with_its_true_makespan(mode: str) -> None:
    rng = random.Random(7)
    for _ in range(50):
        work, cached, cost = _random_case(rng)
        plan = schedule(work, cached, cost, mode)
        assert plan.makespan_ms == pytest.approx(_execute(plan, work, cached, cost))
