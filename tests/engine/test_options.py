"""The shared command-line options: one meaning per name in every command, `auto` by default."""

import argparse

import pytest

from engine.cli import main as engine_main
from engine.errors import InvalidRequestError
from engine.options import (
    add_offload_arguments,
    add_sim_link_argument,
    add_spec_arguments,
    generation_config,
    offload_config,
    wants_calibrated_link,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_offload_arguments(parser)
    add_sim_link_argument(parser)
    add_spec_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        parser.set_defaults(**{name: {"temperature": 0.7, "top_p": 1.0, "repetition_penalty": 1.0}.get(name)})
    parser.set_defaults(top_k=0, greedy=False, stop=[], ignore_eos=False)
    return parser.parse_args(argv)


def test_speculation_and_prefetch_default_to_auto():
    config = generation_config(parse())
    assert (config.spec.mode, config.prefetch, config.cutoff) == ("auto", "auto", None)
    assert config.spec.draft_model.endswith("draft")  # the demo's draft, for the demo model
    config.validate()


@pytest.mark.parametrize(
    ("argv", "gbps", "calibrated"),
    [
        ([], None, False),
        (["--sim-link", "16"], 16.0, False),
        (["--sim-link-gbps", "16"], 16.0, False),  # the older spelling, the same meaning
        (["--sim-link", "16", "--sim-link-gbps", "16"], 16.0, False),
        (["--sim-link", "calibrated"], None, True),  # measured by the command, not a number yet
        (["--sim-link", "Calibrated"], None, True),
    ],
)
def test_sim_link_is_gbps_or_calibrated(argv, gbps, calibrated):
    args = parse(*argv)
    assert offload_config(args).sim_link_gbps == gbps
    assert wants_calibrated_link(args) is calibrated


@pytest.mark.parametrize("text", ["fast", "0", "-2", "nan"])
def test_a_bad_sim_link_is_a_usage_error(text, capsys):
    with pytest.raises(SystemExit):
        parse("--sim-link", text)
    assert "--sim-link" in capsys.readouterr().err


def test_two_different_links_are_refused():
    with pytest.raises(InvalidRequestError, match="disagree"):
        offload_config(parse("--sim-link", "4", "--sim-link-gbps", "8"))


@pytest.mark.parametrize("command", ["generate", "tune"])
def test_every_engine_command_reads_sim_link_alike(command, capsys):
    """`python -m engine generate` and `tune` share the one definition (GB/s or calibrated)."""
    extra = ["--prompt", "x"] if command == "generate" else []
    with pytest.raises(SystemExit):
        engine_main([command, *extra, "--sim-link", "fast"])
    assert "give a bandwidth in GB/s (16) or 'calibrated'" in capsys.readouterr().err
