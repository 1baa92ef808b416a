"""Kernels apart from the mechanisms: hand-written autograd Functions, custom ops and memory
helpers that the variants' `attend` paths call, tested against the variants' dense references.
One module per family (`blocks`, `masked`, `cluster`, `local`, `linear`, `span`, `topk`,
`topk_cpu`, `sparse_topk`, `sparse_topk_cpu`, `table`, `memory`), none imported eagerly.
"""
