"""The one skeleton every format's expert store is built by.

Contract: `build_expert_store(format, checkpoint, model, …)` refuses another host precision for a
format whose experts are quantized already, opens the checkpoint's experts in that format
(`ExpertFormat.open`: the disk layout and the first experts checked against the model), and packs
them (`pack_experts`): per MoE layer, the format's layout of one expert, the placement's layout and
buffer (`engine.store.placement`), then each expert written into its row. Experts are read one at
a time straight into their row: loading never holds a layer's experts twice. Layers may differ in
layout (a GGUF file's Q4_K_M gives some down projections Q6_K): the store's `layout` is the
widest, whose size a device slot has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from engine.errors import InvalidConfigError
from engine.formats.base import ExpertFormat, ModelExperts, StoredExperts
from engine.store.host_store import ExpertStore
from engine.store.placement import AS_STORED, AsStored

Report = Callable[[int, int], None]  # (experts done, total)


def refuse_requantization(source: str, kept_as: str, expert_dtype: str) -> None:
    """`source`'s experts are kept `kept_as`; any `expert_dtype` but native is an error."""
    if expert_dtype != "native":
        raise InvalidConfigError(
            f"{source} is quantized already: its experts are kept {kept_as}. "
            f"Load it with --expert-dtype native, not {expert_dtype}."
        )


def build_expert_store(
    expert_format: ExpertFormat,
    checkpoint,
    model: ModelExperts,
    expert_dtype: str,
    placement: AsStored = AS_STORED,
    pin: bool = False,
    report: Report | None = None,
) -> tuple[ExpertStore, StoredExperts]:
    """Every routed expert of `model` from `checkpoint` (the format's `reader`), kept in
    `expert_format` and laid out by `placement`; reported once a layer."""
    if expert_format.kept_quantized:
        refuse_requantization(*expert_format.kept_as(checkpoint), expert_dtype)
    experts = expert_format.open(checkpoint, model)
    return pack_experts(experts, placement, pin, report), experts


def pack_experts(
    experts: StoredExperts,
    placement: AsStored = AS_STORED,
    pin: bool = False,
    report: Report | None = None,
    each_expert: bool = False,
) -> ExpertStore:
    """Pack every expert of every MoE layer into host memory (pinned when `pin`), reported once a
    layer or, with `each_expert`, once an expert."""
    num_experts = experts.model.num_experts
    layouts, layers = {}, {}
    total, done = len(experts.model.layers) * num_experts, 0
    for layer in experts.model.layers:
        stored = experts.layer_layout(layer)
        layouts[layer] = layout = placement.layout(stored)
        layers[layer] = packed = placement.allocate(layout, num_experts, pin, layer)
        write = placement.writer(stored, layout)
        for expert in range(num_experts):
            write(functools.partial(experts.pack, layer, expert), packed[expert])
            done += 1
            if report is not None and (each_expert or expert == num_experts - 1):
                report(done, total)
    widest = max(layouts.values(), key=lambda layout: layout.nbytes)
    return ExpertStore(widest, layers, num_experts, layouts)
