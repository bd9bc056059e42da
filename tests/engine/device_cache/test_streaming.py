"""Streaming: a step that needs more of a layer's experts than the layer's share (a verify over
several tokens, a prefill) passes its misses through transient slots, so every layer keeps
its share of the cache from one step to the next.

On a hand-made store first (3 layers × 6 experts), then on the demo model, where a
verify-sized forward must give the all-resident logits, pin at most `STREAM_DEPTH` misses
at once and leave every layer's kept experts in place.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from engine.config import ExpertBudget, OffloadConfig
from engine.device_cache.eviction import LFUPolicy
from engine.device_cache.expert_cache import STREAM_DEPTH
from engine.loader import load_model
from engine.resources import demo_model_dir
from engine.speculative.prefetch import install_prefetch
from tests.engine.cache_helpers import NUM_EXPERTS, NUM_LAYERS, ManualTransfer, make_cache, use


def streamed_use(cache, key):
    slot = cache.acquire(key, streaming=True)
    cache.wait(slot)
    cache.release(slot)
    return slot


def test_only_an_lru_step_needing_more_than_its_layers_share_streams(store, link) -> None:
    cache = make_cache(store, link, n_slots=STREAM_DEPTH + 2 * NUM_LAYERS)  # a kept share of 2 per layer
    assert cache.kept_share() == 2
    assert cache.streams(3) and not cache.streams(2)
    assert not make_cache(store, link, n_slots=8, policy=LFUPolicy()).streams(3)
    assert not make_cache(store, link, n_slots=NUM_LAYERS * NUM_EXPERTS).streams(NUM_EXPERTS)


def test_misses_beyond_the_kept_share_are_transient_and_evicted_first(store, link) -> None:
    cache = make_cache(store, link, n_slots=STREAM_DEPTH + 2 * NUM_LAYERS)  # keeps 2 per layer
    kept = [(layer, expert) for layer in (1, 2) for expert in (0, 1)]
    for key in kept:
        use(cache, key)
    streamed = [streamed_use(cache, (0, expert)) for expert in range(5)]
    assert [s.transient for s in streamed] == [False, False, True, True, True]
    kept += [(0, 0), (0, 1)]
    assert all(key in cache for key in kept)  # the streamed misses evicted only each other
    assert (0, 4) in cache and (0, 2) not in cache  # the least recently used transient went first

    use(cache, (1, 5))  # another layer's ordinary miss also takes a transient slot
    assert all(key in cache for key in kept) and (1, 5) in cache


def test_a_transient_expert_used_again_is_kept(store, link) -> None:
    cache = make_cache(store, link, n_slots=STREAM_DEPTH + 2 * NUM_LAYERS)
    for expert in range(3):
        streamed_use(cache, (0, expert))
    slot = streamed_use(cache, (0, 2))  # a hit on the transient slot
    assert not slot.transient
    cache.clear()
    assert not any(s.transient for s in cache.slots)


def test_a_spare_only_prefetch_takes_a_transient_slot_and_never_a_kept_one(store, link) -> None:
    cache = make_cache(store, link, n_slots=STREAM_DEPTH + 2 * NUM_LAYERS)  # keeps 2 per layer
    kept = [(layer, expert) for layer in range(NUM_LAYERS) for expert in (0, 1)]
    for key in kept:
        use(cache, key)
    assert cache.prefetch((1, 2), spare_only=True)  # the free slots first
    assert cache.prefetch((1, 3), spare_only=True)
    assert not cache.prefetch((1, 4), spare_only=True)  # both spare slots hold prefetches not used yet
    assert all(key in cache for key in kept)
    assert cache.streamed((1, 2)) and cache.streamed((1, 9)) and not cache.streamed((0, 0))

    slot = streamed_use(cache, (1, 2))  # the layer holds its share: the prefetch stays transient
    assert slot.transient and cache.stats.phases["decode"].prefetch_used == 1
    assert cache.prefetch((1, 4), spare_only=True)  # a used transient slot is spare again
    assert (1, 2) not in cache and all(key in cache for key in kept)


def test_a_spare_prefetch_is_kept_when_its_layer_has_room(store, link) -> None:
    cache = make_cache(store, link, n_slots=STREAM_DEPTH + 2 * NUM_LAYERS)
    assert cache.prefetch((2, 5), spare_only=True)
    assert not streamed_use(cache, (2, 5)).transient


def test_mispredicted_spare_prefetches_expire_when_their_layer_computes(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer, n_slots=STREAM_DEPTH + 2 * NUM_LAYERS)
    kept = [(layer, expert) for layer in range(NUM_LAYERS) for expert in (0, 1)]
    for key in kept:
        use(cache, key)
    cache.prefetch((0, 2), spare_only=True)
    cache.prefetch((0, 3), spare_only=True)
    for copy in transfer.in_flight():
        copy.land()
    cache.expire_prefetches(0, needed={3, 4})
    decode = cache.stats.phases["decode"]
    assert (decode.prefetched, decode.prefetch_wasted) == (2, 1)  # (0, 2): not needed
    streamed_use(cache, (0, 4))  # the miss takes the expired slot, no layer's kept expert
    assert (0, 2) not in cache and (0, 3) in cache and all(key in cache for key in kept)


def test_a_verify_sized_forward_streams_keeps_every_layers_share_and_matches_resident_logits():
    folder = str(demo_model_dir())
    resident = load_model(folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse("all")))
    model = load_model(folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse(24)))
    try:
        cache, layers = model.cache, len(model.store.layer_indices)
        outstanding, most = set(), 0
        acquire, release = cache.acquire, cache.release

        def counted_acquire(key, streaming=False):
            nonlocal most
            miss = key not in cache
            slot = acquire(key, streaming)
            if miss:
                outstanding.add(slot.index)
                most = max(most, len(outstanding))
            return slot

        def counted_release(slot):
            release(slot)
            if slot.pins == 0:
                outstanding.discard(slot.index)

        cache.acquire, cache.release = counted_acquire, counted_release
        ids = torch.arange(5, 45)  # 40 tokens route to every expert of every layer
        expected = resident.forward(ids, None)
        hits_before, kept_before = 0, 0
        for _ in range(2):
            torch.testing.assert_close(model.forward(ids, None), expected, rtol=0, atol=0)
            kept = [
                sum(1 for s in cache.slots if s.key is not None and s.key[0] == layer and not s.transient)
                for layer in model.store.layer_indices
            ]
            assert min(kept) >= (cache.n_slots - STREAM_DEPTH) // layers, kept
            hits = cache.stats.phases["decode"].hits
            assert hits - hits_before >= kept_before  # what the last step kept, this one hit
            hits_before, kept_before = hits, sum(kept)
        assert most <= STREAM_DEPTH
    finally:
        model.close()
        resident.close()


def test_a_streamed_forward_copies_the_next_layers_experts_after_its_own_misses():
    """SP-MoE's lookahead: once a streamed layer has issued its misses, up to `STREAM_DEPTH`
    experts the next layer's router picks from this layer's input are copied into spare slots,
    so the link does not wait for the next layer's attention. The logits stay exact."""
    folder = str(demo_model_dir())
    resident = load_model(folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse("all")))
    model = load_model(folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse(24)))
    prefetch = install_prefetch(model, "spmoe", speculative=True)
    try:
        cache, events = model.cache, []  # ("miss" | "ahead", layer), in issue order
        acquire, spare_prefetch = cache.acquire, cache.prefetch

        def recording_acquire(key, streaming=False):
            if key not in cache:
                events.append(("miss", key[0]))
            return acquire(key, streaming)

        def recording_prefetch(key, phase=None, spare_only=False):
            started = spare_prefetch(key, phase, spare_only)
            if started:
                events.append(("ahead", key[0]))
            return started

        cache.acquire, cache.prefetch = recording_acquire, recording_prefetch
        cache.phase = "verify"
        text = "The capital of France is Paris. Cats like fish."  # 11 tokens: ~11 experts a layer
        ids = torch.tensor(AutoTokenizer.from_pretrained(folder)(text)["input_ids"])
        torch.testing.assert_close(model.forward(ids, None), resident.forward(ids, None), rtol=0, atol=0)

        layers = model.store.layer_indices
        aheads = [layer for kind, layer in events if kind == "ahead"]
        assert aheads and layers[0] not in aheads  # nothing is ahead of the first layer
        for layer in set(aheads):
            assert aheads.count(layer) <= STREAM_DEPTH
            previous = layers[layers.index(layer) - 1]
            first_ahead = events.index(("ahead", layer))
            assert ("miss", previous) not in events[first_ahead:], "issued before the last miss of its layer"
        verify = cache.stats.phases["verify"]
        assert verify.prefetched == len(aheads) and verify.prefetch_hits > 0
        cache.settle_prefetches()
        assert verify.prefetched == verify.prefetch_used + verify.prefetch_wasted
    finally:
        prefetch.close(model)
        model.close()
        resident.close()
