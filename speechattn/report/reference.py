"""Reference accuracies from the study (Table 2 of the source paper; docs/report.md).

LibriSpeech, 6-layer AALBERT pretrained 500k steps on train-clean-360; speaker tasks on
train-clean-100, phoneme tasks on train-clean-360 with CPC alignments. `ldsa` was not part of
the study, so it has no reference row.
"""

from __future__ import annotations

from speechattn.tasks.records import TASKS

REFERENCE_TASKS = TASKS  # column order of the rows below

REFERENCE: dict[str, tuple[float, float, float, float]] = {
    "mel": (0.0060, 0.0033, 0.5246, 0.5768),
    "full": (0.9926, 0.9824, 0.6460, 0.6887),
    "shared_qk": (0.9898, 0.9622, 0.5893, 0.6345),
    "sparse_strided": (0.9786, 0.9039, 0.6048, 0.6450),
    "sparse_fixed": (0.9597, 0.7960, 0.6069, 0.6846),
    "sign_alsh": (0.9716, 0.8237, 0.5863, 0.6393),
    "xbox": (0.9639, 0.7994, 0.5860, 0.6262),
    "xbox_qnf": (0.9667, 0.7958, 0.5819, 0.6241),
    "simple_lsh": (0.9628, 0.7370, 0.5771, 0.6189),
    "simple_alsh": (0.9678, 0.7999, 0.5783, 0.6214),
    "syn_dense": (0.9660, 0.9027, 0.6180, 0.6287),
    "syn_dense_mh": (0.9509, 0.9135, 0.6073, 0.6471),
    "syn_random": (0.9803, 0.8868, 0.5820, 0.6237),
    "syn_fixed": (0.9842, 0.9855, 0.6157, 0.6492),
}


def reference_accuracy(variant: str, task: str) -> float | None:
    """The study's accuracy for `variant` on `task`, or None when it has none."""
    row = REFERENCE.get(variant)
    if row is None or task not in REFERENCE_TASKS:
        return None
    return row[REFERENCE_TASKS.index(task)]
