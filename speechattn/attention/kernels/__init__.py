"""Kernels apart from the mechanisms: hand-written autograd Functions, custom ops and memory
helpers that the variants' `attend` paths call (tested against the variants' dense references),
one module per family, none imported eagerly."""
