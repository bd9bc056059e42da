"""Seeds: 0 <= seed < 2**63 on every path (the API, the CLI, the draft's generator), and a seed
outside it is refused by name instead of crashing torch's manual_seed."""

import subprocess
import sys

import pytest

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import InvalidRequestError
from engine.generation import generate_text
from engine.generation_config import SEED_LIMIT, GenerationConfig, SamplingConfig, SpecConfig, derived_seed
from engine.loader import load_model
from engine.sampling import Sampler
from engine.speculative.decoder import _draft_sampling

TOP = SEED_LIMIT - 1  # 9223372036854775807


@pytest.mark.parametrize("seed", [-1, SEED_LIMIT, 2**64, True, 1.0, "7"], ids=repr)
def test_a_seed_outside_the_range_is_refused_by_name(seed):
    with pytest.raises(InvalidRequestError) as err:
        SamplingConfig(seed=seed).validate()
    message = str(err.value)
    assert message.startswith("seed must be an integer from 0 to 2**63 - 1 (9223372036854775807)")
    assert message.endswith(f"got {seed!r}") and "\n" not in message


@pytest.mark.parametrize("seed", [None, 0, 7, TOP])
def test_a_seed_in_the_range_makes_a_sampler(seed):
    SamplingConfig(seed=seed).validate()
    assert (Sampler(SamplingConfig(seed=seed)).generator is None) == (seed is None)


def test_the_draft_seed_wraps_at_the_top_of_the_range():
    assert derived_seed(None, 1) is None
    assert derived_seed(7, 1) == 8
    assert derived_seed(TOP, 1) == 0
    draft = _draft_sampling(SamplingConfig(temperature=1.0, seed=TOP))
    assert draft.seed == 0
    draft.validate()  # the draft's Sampler validates it too


def test_the_top_seed_samples_speculatively_and_reproducibly(good_model):
    """Self-speculation builds a second, seed+1 sampler for the draft: at 2**63 - 1 it must not
    overflow, and the same seed gives the same reply."""
    config = GenerationConfig(
        max_new_tokens=6,
        ignore_eos=True,
        sampling=SamplingConfig(temperature=1.0, seed=TOP),
        spec=SpecConfig(mode="self", draft_len=3),
    )
    model = load_model(good_model, OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=8)))
    try:
        first, second = generate_text(model, [1, 2, 3], config), generate_text(model, [1, 2, 3], config)
    finally:
        model.close()
    assert len(first.token_ids) == 6 and first.token_ids == second.token_ids


def test_the_cli_refuses_a_seed_of_2_to_the_63():
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--seed", str(SEED_LIMIT), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: seed must be an integer from 0 to 2**63 - 1 (9223372036854775807), or unset for a new "
        "draw each time; got 9223372036854775808"
    ]
