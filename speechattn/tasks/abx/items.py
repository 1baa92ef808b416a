"""ABX items: the triphones (phone in context) of frame-level phone labels, and their frames.

An item is a maximal run of one phone label in an utterance together with the run before it
and the run after it (ZeroSpeech 2017 and Libri-light item files: onset, offset, phone,
previous phone, next phone, speaker). It spans the three runs' 10 ms frames; its context is
(previous phone, next phone) and its center the middle run's phone. Runs of unlabelled frames
(-100, padding) are never part of an item. docs/abx.md gives the definition and its source.

Shape letters: I items, U utterances, N 10 ms label frames of all utterances together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Items:
    """Triphone items, one row per item (arrays of shape (I,), int64).

    utt: the utterance's index; start, end: the span [start, end) in 10 ms label frames of
    the utterance; prev, center, next: phone ids; speaker: the utterance's speaker id.
    """

    utt: np.ndarray
    start: np.ndarray
    end: np.ndarray
    prev: np.ndarray
    center: np.ndarray
    next: np.ndarray
    speaker: np.ndarray

    def __len__(self) -> int:
        return len(self.utt)

    def subset(self, keep: np.ndarray) -> Items:
        """The items selected by `keep` (a boolean mask (I,) or indices)."""
        return Items(**{k: v[keep] for k, v in vars(self).items()})


def triphone_items(phones: Sequence[np.ndarray], speakers: Sequence[int]) -> Items:
    """The triphone items of U utterances: `phones[u]` (T_u,) phone ids per 10 ms frame (< 0:
    unlabelled), `speakers[u]` the utterance's speaker. Items come in utterance and time order."""
    lengths = np.array([len(p) for p in phones], dtype=np.int64)  # (U,)
    labels = np.concatenate([np.asarray(p, dtype=np.int64) for p in phones] or [np.zeros(0)])
    utt = np.repeat(np.arange(len(phones)), lengths)  # (N,)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    new_run = np.ones(len(labels), dtype=bool)
    new_run[1:] = (labels[1:] != labels[:-1]) | (utt[1:] != utt[:-1])
    run_start = np.flatnonzero(new_run)  # (R,) first frame of each run
    run_end = np.append(run_start[1:], len(labels)).astype(np.int64)
    run_label, run_utt = labels[run_start], utt[run_start]
    mid = np.arange(1, max(len(run_start) - 1, 1))  # runs with a run on either side
    ok = (
        (run_utt[mid - 1] == run_utt[mid])
        & (run_utt[mid + 1] == run_utt[mid])
        & (run_label[mid - 1] >= 0)
        & (run_label[mid] >= 0)
        & (run_label[mid + 1] >= 0)
    ) if len(run_start) >= 3 else np.zeros(0, dtype=bool)  # fmt: skip
    mid = mid[ok]
    u = run_utt[mid]
    return Items(
        utt=u,
        start=run_start[mid - 1] - offsets[u],
        end=run_end[mid + 1] - offsets[u],
        prev=run_label[mid - 1],
        center=run_label[mid],
        next=run_label[mid + 1],
        speaker=np.asarray(speakers, dtype=np.int64)[u],
    )


def frame_span(
    start: np.ndarray, end: np.ndarray, factor: int, num_frames: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The representation frames [first, stop) of label spans [start, end) (10 ms frames).

    Frame j of a representation at `factor` x 10 ms covers label frames factor j ..
    factor j + factor - 1 (the model stacks 3 mel frames: factor 3); it belongs to a span when
    its middle label frame, factor j + (factor - 1) // 2, lies in the span, i.e. when its
    centre in time lies between the span's onset and offset. factor 1 (mel) keeps the span
    as it is. `num_frames` (I,): each item's utterance length in representation frames, which
    caps `stop`. An empty span (stop <= first) is an item too short for the frame rate.
    """
    middle = (factor - 1) // 2
    first = -((middle - start) // factor)  # ceil((start - middle) / factor), >= 0
    stop = (end - 1 - middle) // factor + 1
    return first, np.minimum(stop, num_frames)
