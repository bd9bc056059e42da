"""engine.decode.piecewise_step on the CPU: a one-token step as graph pieces over a device cache
that misses, run by the stand-in capture (`eager_capture`: the body again, the host's work inline
at each cut), against the model's own eager steps — on a standard family (the standard body), on
two whose modules the graph holds; each layer's host synchronisation counted; the pieces under
FakeTensorMode (what the graphs hold reads nothing on the host: the routes are read between them);
the pieces replayed one at a time (`stepping_capture`: the body stops at each cut while the host
works, as replays alternate with it on CUDA); the CPU computing misses inside the pieces against the
all-device path. tests/engine/cuda captures the pieces for real."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.bench.op_counts import count_ops
from engine.config import ExpertBudget, OffloadConfig
from engine.decode.captured_step import eager_capture
from engine.decode.paths import StepPaths
from engine.decode.piecewise_step import PieceGraphs, Pieces, PiecewiseStep
from engine.loader import load_model
from engine.model import kv_cache as kv_cache_module
from engine.moe.cpu_misses import HybridExecutor
from tests.engine.decode.test_captured_step import PROMPT, STEPS, _Folders, _greedy, _with_graph

FAMILIES = ("qwen3_moe", "deepseek_v2", "gpt_oss")
SLOTS = 6  # of 16 or 24 experts: every step misses some


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory.mktemp("pieces"))


def _budgeted(folder, slots: int = SLOTS, policy: str = "lru"):
    """`folder` on a simulated link with `slots` device slots, experts computed together (CUDA's way)."""
    budget = ExpertBudget.parse(str(slots))
    options = {"expert_budget": budget, "sim_link_gbps": 50.0, "policy": policy}
    config = OffloadConfig(device="cpu", dtype="float32", **options)
    model = load_model(folder, config)
    model.control.grouped = True
    return model


def _with_pieces(model, capture=None) -> PiecewiseStep:
    pieces = model.pieces = PiecewiseStep.of(model, _with_graph(model), capture=eager_capture)
    if capture is not None:  # a capture of these pieces
        pieces._capture = capture(pieces.pieces)
    model.paths = StepPaths.of(model.hf_model, model.lean, None, model.captured, pieces)
    return pieces


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_pieces_compute_the_models_steps(folders, model_type, monkeypatch):
    monkeypatch.setattr(kv_cache_module, "GROW_MIN_POSITIONS", 3)  # recaptures as the buffers grow
    eager, model = _budgeted(folders[model_type]), _budgeted(folders[model_type])
    try:
        want_tokens, want_logits = _greedy(eager, eager.decode)
        pieces = _with_pieces(model)
        assert model.paths.names[:2] == ["cuda-graph", "cuda-pieces"]
        tokens, logits = _greedy(model, model.decode)
        assert model.paths.log.counts["cuda-pieces"] == STEPS, model.paths.log.reasons
        assert "holds every expert" not in model.paths.log.reasons.get("cuda-pieces", "")
        assert pieces.captures >= 2 and pieces.off_because is None
        assert tokens == want_tokens
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        used, eager_used = (m.cache.stats.phases["decode"] for m in (model, eager))
        assert used.misses > 0 and used.hits + used.misses == eager_used.hits + eager_used.misses
        assert not pieces.pieces._pinned  # every slot released after a step
        assert pieces.pieces.planned >= len(model.experts) * STEPS and pieces.pieces.plan_us_per_layer > 0
    finally:
        eager.close()
        model.close()


def test_a_token_synchronises_once_a_moe_layer(folders):
    model = _budgeted(folders["qwen3_moe"])
    try:
        _with_pieces(model)
        counts = count_ops(model, PROMPT.tolist(), 3)
        layers = len(model.experts)
        # each layer's routes, and the sampled token (a float32 one's read shows as no sync here)
        assert layers <= counts["host_syncs"] <= layers + 1, counts
        assert model.paths.log.counts["cuda-pieces"] > 0
    finally:
        model.close()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_pieces_read_nothing_on_the_host(folders, model_type):
    """The body with a cut at each MoE layer's experts (as captured: the host's work left to the
    replay) runs under FakeTensorMode."""
    model = _budgeted(folders[model_type])
    try:
        pieces = PiecewiseStep.of(model, _with_graph(model), capture=eager_capture)
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        buffers = tuple(layer.room(1) for layer in cache.layers)
        inputs = pieces._inputs(buffers, 17, cache.get_seq_length(), torch.device("cpu"))
        cuts = []
        pieces.pieces.cut = lambda: cuts.append(1)
        with model.control.installed(pieces=pieces.pieces), FakeTensorMode(allow_non_fake_inputs=True):
            logits = pieces._run(pieces.body, *inputs)
        assert logits.shape == (model.hf_config.get_text_config().vocab_size,)
        assert len(cuts) == len(model.experts) and set(pieces.pieces.routes) == set(model.experts)
    finally:
        model.close()


class _Stepping:
    """The body in a thread that stops at each cut: `run(0)` starts it, `run(i)` lets it go on to
    the next cut (or its end, the logits copied into `out`)."""

    TIMEOUT_S = 60

    def __init__(self, fn, inputs: tuple, pieces: Pieces, out: torch.Tensor):
        self.fn, self.inputs, self.pieces, self.out = fn, inputs, pieces, out
        self._go, self._stopped = threading.Semaphore(0), threading.Semaphore(0)
        self.error: BaseException | None = None

    def run(self, piece: int) -> None:
        if piece == 0:
            threading.Thread(target=self._body, daemon=True).start()
        else:
            self._go.release()
        assert self._stopped.acquire(timeout=self.TIMEOUT_S), "a piece did not reach its cut"
        if self.error is not None:
            raise self.error

    def _body(self) -> None:
        self.pieces.cut = self._cut
        try:
            with torch.inference_mode():
                self.out.copy_(self.fn(*self.inputs))
        except BaseException as err:  # handed to the host's thread
            self.error = err
        finally:
            self.pieces.cut = None
            self._stopped.release()

    def _cut(self) -> None:
        self._stopped.release()
        assert self._go.acquire(timeout=self.TIMEOUT_S), "the host did not replay the next piece"


class _Piece:
    def __init__(self, stepping: _Stepping, index: int):
        self.stepping, self.index = stepping, index

    def replay(self) -> None:
        self.stepping.run(self.index)


def stepping_capture(pieces: Pieces):
    """`capture_pieces`' contract off CUDA: the body run once with the host's work inline, then
    each replay of a piece runs the body from one cut to the next (`_Stepping`), the host's work
    done by `PieceGraphs.replay` between them."""

    def capture(fn, inputs: tuple, pool) -> tuple[PieceGraphs, torch.Tensor]:
        out = fn(*inputs).clone()
        pieces.release()
        stepping = _Stepping(fn, inputs, pieces, out)
        count = len(pieces.layers) * (1 + pieces.split) + 1
        # the routes and inputs the body records as it runs, each replay's own
        return PieceGraphs(
            [_Piece(stepping, i) for i in range(count)], pieces, pieces.routes, pieces.inputs
        ), out

    return capture


@pytest.mark.parametrize("capture", [None, stepping_capture], ids=["inline", "stepping"])
@pytest.mark.parametrize("cpu_experts", ["never", "always"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_the_cpu_computes_misses_inside_the_pieces(folders, model_type, cpu_experts, capture):
    """HybriMoE's split inside the pieces: the CPU's misses sent to the zero row, computed from the
    host store and added after the device's — the all-device eager path's greedy tokens and logits."""
    eager, model = _budgeted(folders[model_type]), _budgeted(folders[model_type])
    try:
        want_tokens, want_logits = _greedy(eager, eager.decode)
        pieces = _with_pieces(model, capture)
        with model.control.installed(hybrid=HybridExecutor(model, cpu_experts)):
            tokens, logits = _greedy(model, model.decode)
        assert model.paths.log.counts["cuda-pieces"] == STEPS, model.paths.log.reasons
        assert pieces.pieces.split is (cpu_experts == "always") and pieces.off_because is None
        assert tokens == want_tokens
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        used, eager_used = (m.cache.stats.phases["decode"] for m in (model, eager))
        assert (used.cpu_computed > 0) is (cpu_experts == "always")
        assert used.hits + used.misses == eager_used.hits + eager_used.misses
        assert not model.cache.pool[model.cache.zero_row].any()  # nothing ever written there
    finally:
        eager.close()
        model.close()


def test_the_pieces_are_captured_again_when_the_cpu_starts_computing_misses(folders):
    model = _budgeted(folders["qwen3_moe"])
    try:
        pieces = _with_pieces(model, stepping_capture)
        cache = model.new_kv_cache()
        token = int(model.forward(PROMPT, cache)[-1].argmax())
        graphs = []
        for hybrid in (None, HybridExecutor(model, "always"), HybridExecutor(model, "always"), None):
            with model.control.installed(hybrid=hybrid):
                assert pieces.refusal(cache) == ""
                token = int(model.decode(token, cache).argmax())
            graphs.append(len(pieces._graphs[True, 1, None].graph.graphs))
        layers = len(model.experts)
        assert graphs == [layers + 1, 2 * layers + 1, 2 * layers + 1, layers + 1]
        assert pieces.captures == 3
    finally:
        model.close()


def test_a_score_policy_sees_the_routers_scores_between_pieces(folders, monkeypatch):
    """MRS weighs experts by their routing scores: the pieces hand each layer's to it, as the
    eager layer does, and evict as the eager steps do."""
    eager, model = (_budgeted(folders["qwen3_moe"], policy="mrs") for _ in range(2))
    try:
        want_tokens, want_logits = _greedy(eager, eager.decode)
        _with_pieces(model)
        seen = []
        observe = model.cache.policy.observe_scores
        monkeypatch.setattr(model.cache.policy, "observe_scores", lambda *a: (seen.append(a), observe(*a)))
        tokens, logits = _greedy(model, model.decode)
        assert model.paths.log.counts["cuda-pieces"] == STEPS, model.paths.log.reasons
        assert tokens == want_tokens and len(seen) == len(model.experts) * (STEPS + 1)  # the prompt too
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        used, eager_used = (m.cache.stats.phases["decode"] for m in (model, eager))
        assert used.hits + used.misses == eager_used.hits + eager_used.misses
    finally:
        eager.close()
        model.close()


def test_a_cache_holding_every_expert_leaves_the_step_to_the_one_graph(folders):
    model = _budgeted(folders["qwen3_moe"], slots=10_000)
    try:
        model.cache.fill()
        pieces = _with_pieces(model)
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        assert "holds every expert" in pieces.refusal(cache)
        model.decode(5, cache)
        assert model.paths.log.counts["cuda-graph"] == 1
    finally:
        model.close()
