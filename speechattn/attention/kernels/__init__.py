"""Kernels apart from the mechanisms: hand-written autograd Functions, custom ops and memory
helpers that the variants' `attend` paths call. Each variant module (`attention/<name>.py`)
holds the definition, its options, `attend`, `attend_dense`, FLOPs and the choice of kernel;
the kernels here are tested against those dense references.

* `memory`: lazily zeroed tensors (`lazy_zeros`).
* `blocks`: the sparse patterns' blocked kernels (bands, blocks, residue classes, summary
  columns; also longformer's and routing's local heads).
* `masked`: the same patterns' one-SDPA-call-per-head-group kernel, the pattern as a mask
  (`masked_heads`, `pattern_bias`).
* `local`: LDSA's window sum (`LocalWeightedSum`).
* `linear`: linear attention with a hand-written backward (`LinearKernel`).
* `span`: the adaptive span's CPU kernels (`FlashThenUnfused`, `UnfusedSavedWeights`).
* `cluster`: routing's cluster kernel and the sizes of its tables (`cluster_kernel`,
  `num_clusters`, `capacity_bound`, `blocks_bound`).
* `topk`: LSH's exact top-k by code match (`topk_by_match`: a threshold on the match
  counts, scores for the tied keys only), the tensor version GPUs run.
* `topk_cpu`: the same on the CPU, one numba kernel per layer (the custom op
  `speechattn::lsh_topk_cpu`; `CPUKernel`, the threaded and serial builds).
* `sparse_topk`: attention over each query's selected keys (`sparse_topk_attention`, the
  custom ops `speechattn::topk_attention[_backward]`): CSR products on GPUs, and
* `sparse_topk_cpu`: its numba kernels on the CPU.
* `table`: the random synthesizers' table kernels (`TableWindows`, `TableAttention`,
  `GradientMemory`).

Nothing here is imported eagerly: `base.py` imports `memory`, and each variant its own kernels.
"""
