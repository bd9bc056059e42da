"""Eviction policies on hand-worked sequences, plus a randomized contract check."""

import random

import pytest

from engine.device_cache.eviction import (
    POLICIES,
    EvictionPolicy,
    ExpertKey,
    LFUPolicy,
    LRUPolicy,
    MRSPolicy,
    make_policy,
)

A, B, C, D = (0, 0), (0, 1), (0, 2), (1, 0)


def _insert_all(policy: EvictionPolicy, keys: list[ExpertKey]) -> None:
    for key in keys:
        policy.on_insert(key)


# LRU


def test_lru_evicts_least_recently_accessed() -> None:
    policy = LRUPolicy()
    _insert_all(policy, [A, B, C])
    assert policy.victim([A, B, C]) == A
    policy.on_access(A)
    assert policy.victim([A, B, C]) == B
    policy.on_access(B)
    assert policy.victim([A, B, C]) == C


def test_lru_insert_counts_as_access() -> None:
    policy = LRUPolicy()
    _insert_all(policy, [A, B])
    policy.on_access(A)
    policy.on_insert(C)
    assert policy.victim([A, C]) == A


def test_lru_only_chooses_among_candidates() -> None:
    policy = LRUPolicy()
    _insert_all(policy, [A, B, C])
    # A is oldest but in use, so not a candidate.
    assert policy.victim([B, C]) == B


def test_lru_reinserted_key_is_fresh() -> None:
    policy = LRUPolicy()
    _insert_all(policy, [A, B])
    policy.on_remove(A)
    policy.on_insert(A)
    assert policy.victim([A, B]) == B


# LFU


def test_lfu_evicts_least_frequent() -> None:
    policy = LFUPolicy()
    _insert_all(policy, [A, B, C])
    for key in [A, A, A, B, C, C]:
        policy.on_access(key)
    # counts: A=3, B=1, C=2
    assert policy.victim([A, B, C]) == B
    policy.on_access(B)
    policy.on_access(B)
    # counts: A=3, B=3, C=2
    assert policy.victim([A, B, C]) == C


def test_lfu_ties_go_to_least_recent() -> None:
    policy = LFUPolicy()
    _insert_all(policy, [A, B, C])
    for key in [B, C, A]:
        policy.on_access(key)
    # all at 1; B accessed longest ago
    assert policy.victim([A, B, C]) == B
    policy.on_access(B)
    policy.on_access(C)
    policy.on_access(A)
    # all at 2 again, B still oldest; now C at 3 beats it
    policy.on_access(C)
    assert policy.victim([A, B, C]) == B
    assert policy.victim([A, C]) == A


def test_lfu_insert_does_not_count_and_eviction_resets() -> None:
    policy = LFUPolicy()
    _insert_all(policy, [A, B])
    assert policy.access_count(A) == 0
    for _ in range(5):
        policy.on_access(A)
    policy.on_access(B)
    assert policy.victim([A, B]) == B
    policy.on_remove(A)
    assert policy.access_count(A) == 0
    policy.on_insert(A)
    policy.on_access(A)
    # A is back at 1, tied with B, and accessed more recently.
    assert policy.victim([A, B]) == B
    policy.on_access(B)
    assert policy.victim([A, B]) == A


# MRS


def test_mrs_exact_scores_after_two_updates() -> None:
    policy = MRSPolicy(alpha=0.5, top_p=2)
    policy.observe_scores(0, [0.1, 0.4, 0.3, 0.2])
    # top-2 are experts 1 and 2: S = 0.5 * [0, 0.4, 0.3, 0] + 0.5 * 0
    assert [policy.priority((0, e)) for e in range(4)] == pytest.approx([0.0, 0.2, 0.15, 0.0])
    policy.observe_scores(0, [0.5, 0.1, 0.3, 0.1])
    # top-2 are experts 0 and 2: S = 0.5 * [0.5, 0, 0.3, 0] + 0.5 * [0, 0.2, 0.15, 0]
    assert [policy.priority((0, e)) for e in range(4)] == pytest.approx([0.25, 0.1, 0.225, 0.0])


def test_mrs_only_top_p_scores_accumulate() -> None:
    policy = MRSPolicy(alpha=0.5, top_p=2)
    for _ in range(3):
        policy.observe_scores(0, [0.3, 0.29, 0.28, 0.13])
    # expert 2 is third every step: it never accumulates anything
    assert policy.priority((0, 2)) == 0.0
    assert policy.priority((0, 3)) == 0.0
    # experts 0 and 1: 0.3 * (0.5 + 0.25 + 0.125)
    assert policy.priority((0, 0)) == pytest.approx(0.3 * 0.875)
    assert policy.priority((0, 1)) == pytest.approx(0.29 * 0.875)


def test_mrs_keeps_high_score_over_recent_low_score() -> None:
    policy = MRSPolicy(alpha=0.5, top_p=2)
    hot, cold = (0, 0), (0, 3)
    policy.on_insert(hot)  # prefetched, never used by compute yet
    policy.on_insert(cold)
    policy.on_access(cold)
    policy.observe_scores(0, [0.6, 0.2, 0.15, 0.05])
    assert policy.victim([hot, cold]) == cold
    # LRU would have chosen the other one
    lru = LRUPolicy()
    _insert_all(lru, [hot, cold])
    lru.on_access(cold)
    assert lru.victim([hot, cold]) == hot


def test_mrs_scores_decay_and_persist_across_eviction() -> None:
    policy = MRSPolicy(alpha=0.5, top_p=1)
    _insert_all(policy, [A, B])
    policy.observe_scores(0, [0.9, 0.1])
    policy.observe_scores(0, [0.0, 0.8])
    # A: 0.45 -> 0.225; B: 0 -> 0.4
    assert policy.victim([A, B]) == A
    policy.on_remove(B)
    assert policy.priority(B) == pytest.approx(0.4)


def test_mrs_unscored_is_zero_and_ties_go_to_least_recent() -> None:
    policy = MRSPolicy()
    _insert_all(policy, [A, B, D])
    policy.on_access(A)
    assert policy.priority(D) == 0.0
    assert policy.victim([A, B, D]) == B
    policy.observe_scores(0, [0.5, 0.5])
    # layer 1 never scored: D has S = 0
    assert policy.victim([A, B, D]) == D


def test_mrs_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="alpha"):
        MRSPolicy(alpha=0.0)
    with pytest.raises(ValueError, match="top_p"):
        MRSPolicy(top_p=0)
    policy = MRSPolicy()
    policy.observe_scores(0, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="expected 3"):
        policy.observe_scores(0, [0.1, 0.2])


# shared contract


@pytest.mark.parametrize("name", POLICIES)
def test_empty_candidates_raise(name: str) -> None:
    policy = make_policy(name)
    policy.on_insert(A)
    with pytest.raises(ValueError, match="no evictable"):
        policy.victim([])
    with pytest.raises(ValueError):
        policy.victim(iter(()))


@pytest.mark.parametrize("name", POLICIES)
def test_unknown_candidates_and_removes_are_tolerated(name: str) -> None:
    policy = make_policy(name)
    policy.on_remove(A)  # never inserted
    policy.on_insert(B)
    policy.on_access(B)
    assert policy.victim([A, B]) in {A, B}
    assert policy.victim(k for k in [B]) == B


def test_make_policy_names() -> None:
    assert POLICIES == ("lru", "lfu", "mrs")
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("LFU"), LFUPolicy)
    mrs = make_policy("Mrs", top_k=8, alpha=0.3)
    assert isinstance(mrs, MRSPolicy)
    assert (mrs.top_p, mrs.alpha) == (16, 0.3)
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="lru, lfu, mrs"):
        make_policy("fifo")


@pytest.mark.parametrize("name", POLICIES)
def test_randomized_victims_and_bounded_state(name: str) -> None:
    rng = random.Random(1234)
    layers, experts, capacity = 4, 16, 12
    policy = make_policy(name, top_k=2)
    resident: set[ExpertKey] = set()
    for _ in range(5000):
        layer = rng.randrange(layers)
        policy.observe_scores(layer, [rng.random() for _ in range(experts)])
        wanted = (layer, rng.randrange(experts))
        if wanted not in resident:
            if len(resident) == capacity:
                busy = set(rng.sample(sorted(resident), rng.randrange(capacity)))
                candidates = sorted(resident - busy)
                evicted = policy.victim(candidates)
                assert evicted in candidates
                policy.on_remove(evicted)
                resident.remove(evicted)
            policy.on_insert(wanted)
            resident.add(wanted)
        policy.on_access(wanted)
        assert policy.tracked_keys() == resident
    if isinstance(policy, LFUPolicy):
        assert set(policy._accesses) == resident
