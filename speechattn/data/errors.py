"""Bad input (docs/data.md, "Bad input"): `DataError` names the file and the problem, and every
check of the data layer reports through `Issues`: raised under `on_error="error"`; under
"skip" the utterance is dropped, counted and listed, never silently."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from speechattn.errors import ConfigError, SpeechattnError

log = logging.getLogger(__name__)

ON_ERROR_CHOICES = ("error", "skip")


class DataError(SpeechattnError, ValueError):
    """A problem with one input file, e.g. `/x/19-198-0001.flac: truncated audio (...)`:
    `problem` is a short, fixed category such as `"unreadable audio"` (skips are grouped by it),
    `detail` free text with the numbers that show what is wrong."""

    def __init__(
        self, path: str | Path, problem: str, detail: str = "", utt_id: str | None = None
    ) -> None:
        self.path, self.problem, self.detail, self.utt_id = str(path), problem, detail, utt_id
        where = f"{self.path}" + (f" [{utt_id}]" if utt_id else "")
        super().__init__(f"{where}: {problem}" + (f" ({detail})" if detail else ""))

    def __reduce__(self):  # picklable across worker processes, subclasses keeping their type
        return (type(self), (self.path, self.problem, self.detail, self.utt_id))


@dataclass(frozen=True)
class Skip:
    """One utterance left out under `on_error="skip"`."""

    utt_id: str | None
    path: str
    problem: str
    detail: str
    stage: str  # "scan", "audio", "labels", ...

    def __str__(self) -> str:
        return str(DataError(self.path, self.problem, self.detail, self.utt_id))


@dataclass
class Issues:
    """Ledger of bad input: raises under `on_error="error"`, records under `"skip"`."""

    on_error: str = "error"
    skips: list[Skip] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR_CHOICES:
            msg = f"on_error must be one of {ON_ERROR_CHOICES}, found {self.on_error!r}"
            raise ConfigError(msg)

    def report(self, error: DataError, stage: str) -> None:
        if self.on_error == "error":
            raise error
        self.skips.append(Skip(error.utt_id, error.path, error.problem, error.detail, stage))

    @property
    def skipped_ids(self) -> set[str]:
        return {s.utt_id for s in self.skips if s.utt_id}

    def counts(self) -> Counter[str]:  # skips per problem
        return Counter(s.problem for s in self.skips)

    def log_summary(self, logger: logging.Logger = log, max_examples: int = 5) -> None:
        """Warn of the skips, if any: their count per problem, then the first `max_examples`."""
        if not self.skips:
            return
        parts = ", ".join(f"{n} {problem}" for problem, n in self.counts().most_common())
        lines = [f"skipped {len(self.skips)} bad input(s): {parts}"]
        lines += [f"  {s}" for s in self.skips[:max_examples]]
        if len(self.skips) > max_examples:
            lines.append(f"  ... and {len(self.skips) - max_examples} more")
        logger.warning("\n".join(lines))
