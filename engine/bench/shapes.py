"""The bench's large-shape GGUF files: `python -m engine.bench.shapes DIR [--types Q4_K_M BF16]`.

Writes a Qwen3-30B-A3B-shaped model cut to 2 layers (hidden 2048, 128 experts × 768, top-8, 32 query
and 4 KV heads of 128, a 40960-token window; random weights, the demo tokenizer) as one GGUF file
per type, the files the side-by-side figures against llama.cpp are measured on (`python -m
engine.bench --vs-llama-cpp FILE`): `Q4_K_M` (routed gate/up and every other matrix Q4_K, down
projections by llama.cpp's Q4_K_M rule: Q6_K in layer 1), `BF16` (every matrix bfloat16; with
`--safetensors` also as a Hugging Face folder of the same bfloat16 weights). Building
one takes a few minutes and ~6 GB of RAM (the model in float32 before it is quantized).

`--layers N` writes the model at depth N for a GPU's expert budget (Qwen3-30B-A3B has 48): the two
random layers are built and quantized once and repeated (layer k holds layer k mod 2's weights), so a
full-depth file of the model's size takes a disk copy's time, not N layers' quantization. Repeated
weights do not change what the bench measures: every layer's experts are separate cache entries.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter

QWEN3_30B_A3B_LAYER = {
    "num_hidden_layers": 2,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
}
TYPES = {  # name: (routed gate/up, routed down, every other matrix)
    "Q4_K_M": (QT.Q4_K, "Q4_K_M", QT.Q4_K),
    "Q8_0": (QT.Q8_0, QT.Q8_0, QT.Q8_0),
    "BF16": (QT.BF16, QT.BF16, QT.BF16),
}


def write_shape(folder: str | Path, type_name: str, seed: int = 0, safetensors: bool = False) -> Path:
    """The Qwen3-30B-A3B-shaped 2-layer model as `folder/qwen3-30b-a3b-2layers-<type>.gguf`;
    `safetensors` (BF16 only): also its very weights as a bfloat16 Hugging Face folder beside it,
    `folder/qwen3-30b-a3b-2layers-BF16-safetensors/`."""
    import torch

    from engine.tiny.gguf_writer import write_tiny_gguf

    if safetensors and type_name != "BF16":
        raise ValueError("only the BF16 file's weights are a bfloat16 checkpoint's without rounding")
    expert, down, other = TYPES[type_name]
    folder = Path(folder)
    name = f"qwen3-30b-a3b-2layers-{type_name}"
    path = write_tiny_gguf(
        folder,
        "qwen3_moe",
        expert_type=expert,
        down_type=down,
        other_type=other,
        seed=seed,
        safetensors_dir=folder / f"{name}-safetensors" if safetensors else None,
        safetensors_dtype=torch.bfloat16,
        **QWEN3_30B_A3B_LAYER,
    )
    return path.replace(folder / f"{name}.gguf")


def repeat_layers(source: str | Path, layers: int) -> Path:
    """`source` at depth `layers`, its blocks repeated in turn, written beside it as `...-<N>layers-...`."""
    source = Path(source)
    reader = GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    depth = reader.fields[f"{arch}.block_count"].contents()
    target = source.with_name(source.name.replace(f"-{depth}layers-", f"-{layers}layers-"))
    if target == source:
        raise ValueError(f"{source.name} does not name its depth as -{depth}layers-")
    writer = GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        writer.add_key_value(
            field.name, value, kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    blocks: dict[int, list] = {}
    shared = []
    for tensor in reader.tensors:
        if m := re.match(r"blk\.(\d+)\.", tensor.name):
            blocks.setdefault(int(m[1]), []).append(tensor)
        else:
            shared.append(tensor)
    order = [(t.name, t) for t in shared]
    for layer in range(layers):
        source_layer = f"blk.{layer % depth}."
        order += [(t.name.replace(source_layer, f"blk.{layer}.", 1), t) for t in blocks[layer % depth]]
    for name, t in order:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in order:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.bench.shapes", description=__doc__.splitlines()[0]
    )
    parser.add_argument("folder", help="where the files are written")
    parser.add_argument("--types", nargs="+", choices=sorted(TYPES), default=["Q4_K_M", "BF16"])
    parser.add_argument(
        "--layers", type=int, default=2, help="depth of the written file (the 2 random layers repeated)"
    )
    parser.add_argument(
        "--safetensors",
        action="store_true",
        help="also write the BF16 file's weights as a bfloat16 Hugging Face folder beside it",
    )
    args = parser.parse_args(argv)
    for type_name in args.types:
        path = write_shape(args.folder, type_name, safetensors=args.safetensors and type_name == "BF16")
        if args.layers != 2:
            path = repeat_layers(path, args.layers)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
