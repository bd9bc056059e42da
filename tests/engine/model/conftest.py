"""Prints how many MoE families test_all_families found exact, last in the run."""

from __future__ import annotations

import re
from collections import defaultdict

_FAMILY_TEST = re.compile(r"test_all_families\.py::(test_\w+)\[([\w-]+)\]")
_outcomes: dict[str, dict[str, str]] = defaultdict(dict)


def pytest_runtest_logreport(report):
    match = _FAMILY_TEST.search(report.nodeid)
    if match and (report.when == "call" or report.outcome != "passed"):
        test, family = match.groups()
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        _outcomes[family].setdefault(test, outcome)


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    exact = sorted(f for f, tests in _outcomes.items() if set(tests.values()) == {"passed"})
    plain_only = sorted(
        f
        for f, tests in _outcomes.items()
        if tests.get("test_logits_and_greedy_tokens_equal_transformers") == "passed" and f not in exact
    )
    terminalreporter.write_sep("=", "MoE families")
    terminalreporter.write_line(
        f"exact (logits, greedy and self-speculation): {len(exact)}: {', '.join(exact)}"
    )
    terminalreporter.write_line(f"exact in plain decoding only: {len(plain_only)}: {', '.join(plain_only)}")
    terminalreporter.write_line(f"exact families: {len(exact)} of {len(_outcomes)} run")
