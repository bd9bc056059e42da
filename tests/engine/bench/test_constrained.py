"""`python -m engine.bench.constrained` runs on the demo model and reports both figures."""

import re

from engine.bench.constrained import main


def test_the_constrained_bench_reports_tpot_and_the_grammars_cost(capsys):
    main(["--device", "cpu", "--new-tokens", "4", "--runs", "1"])
    out = capsys.readouterr().out
    assert re.search(r"engine tpot_ms: free \d+\.\d+, json_schema \d+\.\d+", out), out
    assert re.search(r"llguidance: compile \d+\.\d+ ms, mask .* \d+\.\d+ us a token", out), out
    assert re.search(r"xgrammar: (not installed|compile)", out), out
