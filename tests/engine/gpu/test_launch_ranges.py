"""Each launch of an engine kernel as a range of torch's profiler (`engine.gpu.launch_ranges`), and
how `--count-ops` counts it: one kernel launch, the operators inside it left out."""

import torch

from engine.bench.op_counts import _inside_kernel
from engine.gpu.launch_ranges import RANGE_PREFIX, launch_range


def test_a_launch_is_one_range_and_the_operators_inside_it_are_not_the_step_s() -> None:
    with torch.profiler.profile() as prof:
        with launch_range("moe_down_q6_k"):
            torch.ones(3).add_(1)  # what Triton's interpreter dispatches around a CPU launch
        torch.zeros(2)
    events = prof.events()
    assert [e.name for e in events if e.name.startswith(RANGE_PREFIX)] == [f"{RANGE_PREFIX}moe_down_q6_k"]
    outside = {e.name for e in events if e.name.startswith("aten::") and not _inside_kernel(e)}
    inside = {e.name for e in events if e.name.startswith("aten::") and _inside_kernel(e)}
    assert "aten::zeros" in outside and "aten::ones" not in outside
    assert {"aten::ones", "aten::add_"} <= inside


def test_without_the_profiler_a_launch_records_nothing() -> None:
    assert launch_range("moe_gate_up_q4_k") is launch_range("moe_down_q8_0")  # one shared no-op
