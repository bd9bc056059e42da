"""The decode step: its builders and the one place that chooses a step's path.

- `paths`: the ordered list of decode-step paths (`takes`/`run`), the first that takes a step
  runs it, and the name of the path each step took (`stats.step_path`);
- `lean`: `LeanDecode`, the standard pre-norm decoder without transformers' per-call machinery;
- `captured_step`: `CapturedStep`, a one-token step as one CUDA graph, when every expert is on the
  device; `step_body`: the standard decoder's step as that graph holds it; `fused_decoder`: the
  standard decoder's norms, rotary + KV write, attention and routers in the fused kernels
  (`engine.gpu`) where a probe shows they compute what the modules do;
  `module_step`: another family's own modules in the graph, over a cache written at the device
  position; `piecewise_step`: the step as graph pieces, one a MoE layer, where the cache can miss;
- `cpu_attention`: decode attention on the CPU, query heads folded per key head;
- `fused_norms`: RMS norms as torch's one operator where a probe shows the same values;
- `row_views`: `Row`, a graph input given by its address in a long-lived table;
- `layer_graph`: a standard layer's work before and after attention (and its attention) as
  ggml graphs; `moe_graph`: a MoE block's routing and experts as ggml nodes;
- `graph_chain`: a step's layers chained into one ggml graph; `whole_step`: a step's layers and
  head in that one graph; `one_token`: the one-token step's graph run again on the next token.

May import: every room below it (model, ggml, formats, gpu, store, device_cache, moe, resident).
Never `engine.offloaded_model` (which owns the paths), speculation or anything above.
"""
