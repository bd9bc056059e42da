"""Fused GPU kernels of the decode step (DESIGN.md, "The decode step on a GPU"): few kernels, each
reading quantized bytes once, written in Triton, tested on the CPU in Triton's interpreter, and
shipped as ahead-of-time cubins launched through the CUDA driver (no Triton, no compiler on the
user's machine).

- `kquant_moe` — one token's routed experts from GGUF blocks (Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS,
  IQ4_NL, MXFP4) in the device cache's pool (gate_up + SiLU, down + weight + sum over the top-k),
  and a quantized GEMV for one matrix (`engine.moe.fused_experts` runs the first two in decode
  steps);
- `ggml_dots` — their device code per type: rows of blocks dequantized as
  `engine.formats.gguf.blocks` does and dotted with x;
- `fp8_moe` — the same three from FP8 e4m3 values and their float32 block, row or tensor scales;
- `int4_moe` — the same three from GPTQ, AWQ and compressed-tensors int4 words, zeros, scales and
  act-order's g_idx;
- `routed` — the device code the FP8 and int4 kernels share: an expert's pool row from the slot
  table and the top-k ids, SiLU · up;
- `projections` — what a kernel family reads of one projection of the experts in a pool row, one
  object per stored type (its fields' offsets, its shape, its cubins), made from the ExpertLayout;
- `decoder_kernels` — the standard decoder's one-token work around attention and the experts, the
  position read on the device (a CUDA graph of the step): add + RMS norm, q/k norms + rotary + KV
  write, the router's softmax and top-k;
- `decode_attention` — one query token's attention over a static KV cache, flash-decoding style
  (positions split across programs by the capacity, the length read on the device);
- `smoke` — a one-line kernel that proves the build and the launcher on a new machine;
- `registry` — the kernels the build compiles, each with its signature and constexprs;
- `build` — `python -m engine.gpu.build`: the cubins for sm_80…sm_120 and PTX, each kernel's
  registers and spills checked against a budget; `--check` (CI) that they match the sources;
- `manifest` — the cubins' manifest, and the image a device runs;
- `toolchain` — ptxas and cuobjdump found, their reports read;
- `launcher` — `CubinKernel`: a cubin loaded and launched through the CUDA driver on torch's
  current stream (capturable in a CUDA graph);
- `launch_ranges` — each launch a range of torch's profiler while it records, what
  `python -m engine.bench --count-ops` counts the kernels by;
- `checks` — every registered kernel proven on a GPU (`python -m engine.bench.gpu`): its cubin
  against torch's reference, and its bytes a second against the card's.

May import the engine's base modules, `engine.formats`, torch and triton. Importing this package
imports no triton (users on a CPU may not have it); `kquant_moe`, `ggml_dots`, `fp8_moe`, `int4_moe`,
`routed`, `decoder_kernels`, `decode_attention`, `smoke` and `build` need it.
"""
