"""The phoneme-recognition corpus reader s3prl's ctc task imports (`corpus.name: libriphone`)
and its 0.4.18 wheel lacks; `compat` registers it under s3prl's name. The layout SUPERB uses:

    CSV_DIR/<split>.csv    columns wav_path, transcription (words separated by spaces)
    lexicon files          lines "WORD P1 P2 ...": a word's phonemes
    vocab file             one phoneme per line (s3prl's `text.vocab_file`, `mode: word`)
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from speechattn.data.errors import DataError

log = logging.getLogger(__name__)


def read_lexicon(paths: list[str | Path], vocabulary: set[str]) -> dict[str, list[str]]:
    """Word -> phonemes from lexicon files, the first pronunciation of a word winning (a
    deterministic result); `DataError` names the line of a phoneme not in `vocabulary`."""
    lexicon: dict[str, list[str]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                word, *phonemes = line.split()
                if not phonemes:
                    continue
                unknown = [p for p in phonemes if p not in vocabulary]
                if unknown:
                    raise DataError(
                        Path(path),
                        f"line {number}: phonemes {unknown} of {word!r} are not in the vocabulary",
                        "use the phoneme set of text.vocab_file",
                    )
                lexicon.setdefault(word, phonemes)
    return lexicon


class LibriPhoneDataset(Dataset):
    """(wav_path, phoneme ids) pairs of the split `csv_dir/split_csv`, for s3prl's ctc
    `collect_audio_batch`: targets encoded by s3prl's tokenizer, longest first (`ascending`:
    shortest); with `bucket_size` > 1 an item is that many neighbouring utterances. The rest of
    s3prl's corpus config (**kwargs) is ignored."""

    def __init__(
        self,
        split_csv: str,
        tokenizer: Any,
        bucket_size: int,
        lexicon: list[str],
        csv_dir: str,
        ascending: bool = False,
        **kwargs: Any,
    ) -> None:
        self.bucket_size = bucket_size
        words = read_lexicon(lexicon, set(tokenizer._vocab2idx))
        path = Path(csv_dir) / split_csv
        rows: list[tuple[str, list[int]]] = []
        try:
            with open(path, encoding="utf-8", newline="") as file:
                for number, row in enumerate(csv.DictReader(file), 2):
                    missing = [w for w in row["transcription"].split() if w not in words]
                    if missing:
                        raise DataError(
                            path,
                            f"line {number}: words {missing[:5]} are not in the lexicon",
                            "add them to a lexicon file",
                        )
                    phonemes = [p for w in row["transcription"].split() for p in words[w]]
                    rows.append((row["wav_path"], tokenizer.encode(" ".join(phonemes))))
        except FileNotFoundError as e:
            raise DataError(
                path, "split file not found", "run python -m speechattn.superb.prepare"
            ) from e
        except KeyError as e:
            raise DataError(
                path, f"no column {e}", "expected columns wav_path,transcription"
            ) from e
        rows.sort(key=lambda r: len(r[1]), reverse=not ascending)
        self.file_list, self.text = [r[0] for r in rows], [r[1] for r in rows]
        log.info("%s: %d utterances", path, len(rows))

    def __getitem__(self, index: int) -> tuple[str, list[int]] | list[tuple[str, list[int]]]:
        if self.bucket_size > 1:
            index = max(0, min(len(self.file_list) - self.bucket_size, index))
            end = index + self.bucket_size
            return list(zip(self.file_list[index:end], self.text[index:end]))
        return self.file_list[index], self.text[index]

    def __len__(self) -> int:
        return len(self.file_list)
