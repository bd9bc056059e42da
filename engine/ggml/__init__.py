"""llama.cpp's ggml C library through ctypes: the runtime under `--kernels ggml` on the CPU.

- `library`: the ggml functions the engine calls, with their C signatures, loaded once;
- `memory`: where ggml tensors lie (ggml's own regions, a buffer over torch's memory);
- `graphs`: ggml graphs kept built between decode steps, per thread;
- `kernels`: llama.cpp's CPU matmul kernels on a GGUF weight's blocks, and kept-graph compute;
- `interleave`: llama.cpp's interleaved weight rows (its `CPU_REPACK` buffers).

May import: the engine's base modules and torch. Nothing above: the rooms that build graphs
(`engine.decode`) and keep weights (`engine.store`, `engine.resident`) call into this one.
"""
