"""Which format a checkpoint holds its routed experts in: the first format object that detects it.

Contract: `FORMATS` lists every format a checkpoint may be in, in the order they are asked (a
GGUF file first; the float checkpoint no other format claims last); `detect_format` returns the
first whose `detect` says yes. The engine's own int8/int4 (`IntQuantFormat`) is no checkpoint's
format and is not listed: the loader chooses it for float experts.
"""

from __future__ import annotations

from engine.formats.base import ExpertFormat
from engine.formats.fp8_experts import FP8
from engine.formats.gguf.experts import GGUF_BLOCKS
from engine.formats.int4_experts import INT4
from engine.formats.mxfp4_experts import MXFP4
from engine.formats.native_experts import NATIVE

FORMATS: tuple[ExpertFormat, ...] = (GGUF_BLOCKS, MXFP4, FP8, INT4, NATIVE)


def detect_format(hf_config, checkpoint) -> ExpertFormat:
    """The first of `FORMATS` that finds `checkpoint`'s experts in it."""
    for candidate in FORMATS:
        if candidate.detect(hf_config, checkpoint):
            return candidate
    raise ValueError(f"No expert format reads {checkpoint.folder}.")  # NATIVE reads any safetensors folder
