"""A LibriSpeech-layout corpus of any size, made of hard links, for tests and measurements.

`python -m speechattn.bench corpus --out DIR --utterances N` writes

    DIR/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<utt:04d>.flac   hard links (or copies)
    DIR/<split>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt
    DIR/sources/source-<k>.flac    the few real files: synthesised voiced sounds, 16 kHz FLAC
    DIR/corpus.json                generator version and parameters (a match is reused)

Every utterance links one of the sources, drawn at random (seeded): 100k utterances take a
few seconds and the disk of the sources alone. Hard links share one inode (size, mtime and
content), so a cache that keys or deduplicates by content sees few distinct files (`--copy`
where that matters). Training never reads it; tests, `bench loader` and `bench scale` do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from speechattn.errors import ConfigError, OutputExistsError
from speechattn.utils import progress_bar, temp_name

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1  # bump whenever the output changes
SAMPLE_RATE = 16000
# LibriSpeech-like durations, seconds: train-clean-360 averages ~12.7 s and most utterances
# are 10-17 s, around pretraining's 15 s crop (data.max_frames=1500)
DEFAULT_SECONDS = (3.0, 8.0, 12.0, 14.0, 16.0, 20.0)
UTTERANCES_PER_SPEAKER = 113  # train-clean-360: 104,014 utterances / 921 speakers
WORDS = ("ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL")


def source_audio(seconds: float, seed: int) -> np.ndarray:
    """(round(seconds * 16 kHz),) float32 in [-1, 1): ten harmonics of a pitch that wanders
    around 90-200 Hz, bursts at ~4 syllables per second, faint noise (seeded): the pipeline's
    cost depends on durations, not words."""
    rng = np.random.default_rng([seed, 2027])
    t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = rng.uniform(90, 200) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.3, 1.0) * t))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voiced = sum(np.sin(h * phase) / h for h in range(1, 11))
    bursts = (0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(3.0, 5.0) * t)) ** 2
    audio = 0.25 * voiced * bursts + 0.01 * rng.standard_normal(len(t))
    return np.clip(audio, -1.0, 1.0 - 1 / 32768).astype(np.float32)


def make_scale_corpus(
    out: str | Path,
    utterances: int,
    speakers: int | None = None,
    chapters: int = 2,
    split: str = "train-clean-360",
    seconds: Sequence[float] = DEFAULT_SECONDS,
    seed: int = 0,
    copy: bool = False,
    progress: bool = False,
) -> Path:
    """Write (or reuse) a corpus of `utterances` utterances, spread evenly over `speakers`
    (default: one per `UTTERANCES_PER_SPEAKER`) x `chapters`, into `out`, which must not exist
    unless it holds this very corpus (`corpus.json`); returns `out`. One source file per
    `seconds`; `copy`: copies instead of hard links (also where the filesystem refuses links).
    Written under a temporary name and renamed, so an interrupted build leaves no half corpus.
    """
    import soundfile as sf

    speakers = speakers or max(1, round(utterances / UTTERANCES_PER_SPEAKER))
    if utterances < 1 or speakers < 1 or chapters < 1 or not seconds:
        raise ConfigError(
            f"need utterances, speakers, chapters >= 1 and some --seconds; got {utterances}, "
            f"{speakers}, {chapters}, {list(seconds)}"
        )
    per_chapter = -(-utterances // (speakers * chapters))
    if per_chapter > 9999:
        raise ConfigError(
            f"{per_chapter} utterances per chapter: LibriSpeech ids allow 9999; add speakers"
        )
    out = Path(out)
    # what corpus.json records: an existing corpus is reused only when all of it matches
    params = {
        "generator": "speechattn.bench.corpus",
        "version": GENERATOR_VERSION,
        "utterances": utterances,
        "speakers": speakers,
        "chapters": chapters,
        "split": split,
        "seconds": [float(s) for s in seconds],
        "seed": seed,
        "copy": copy,
    }
    if out.exists():
        found = None
        with contextlib.suppress(OSError, ValueError):
            found = json.loads((out / "corpus.json").read_text())
        if found == params:
            return out
        raise OutputExistsError(
            f"{out} exists and is not this corpus ({params}); remove it or choose another --out"
        )
    start = time.perf_counter()
    tmp = temp_name(out)
    try:
        sources = tmp / "sources"
        sources.mkdir(parents=True)
        paths = []
        for k, s in enumerate(seconds):
            paths.append(sources / f"source-{k}.flac")
            sf.write(paths[-1], source_audio(s, seed * 1000 + k), SAMPLE_RATE, subtype="PCM_16")
        choice = np.random.default_rng([seed, 4099]).integers(len(paths), size=utterances)
        link = not copy
        with progress_bar(utterances, f"corpus of {utterances} utterances", progress) as advance:
            n, cells = 0, speakers * chapters
            for k in range(cells):  # chapter k % chapters of speaker k // chapters
                count = utterances // cells + int(k < utterances % cells)  # spread evenly
                if count == 0:  # more chapters than utterances
                    continue
                speaker, chapter = str(100 + k // chapters), str(10000 + k)
                folder = tmp / split / speaker / chapter
                folder.mkdir(parents=True)
                lines = []
                for u in range(count):
                    utt_id = f"{speaker}-{chapter}-{u:04d}"
                    link = _place(paths[choice[n]], folder / f"{utt_id}.flac", link)
                    lines.append(f"{utt_id} {' '.join(WORDS[: 2 + (n % 6)])}\n")
                    n += 1
                (folder / f"{speaker}-{chapter}.trans.txt").write_text("".join(lines))
                advance(count)
        (tmp / "corpus.json").write_text(json.dumps(params, indent=2))
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "scale corpus %s: %d utterances, %d speakers x %d chapters, %s, in %.1f s",
        out,
        utterances,
        speakers,
        chapters,
        "copies" if copy else "hard links",
        time.perf_counter() - start,
    )
    return out


def _place(source: Path, target: Path, link: bool) -> bool:
    """Hard-link (`link`) or copy `source` at `target`; returns whether to link the next file
    (not once the filesystem has refused a link, so the refusal is logged once)."""
    if link:
        try:
            os.link(source, target)
            return True
        except OSError as e:
            log.warning("hard links refused (%s): copying the audio instead", e)
    shutil.copyfile(source, target)
    return False


def add_seconds_argument(p: argparse.ArgumentParser, help: str) -> None:
    """`--seconds 3,8,...`: the source files' durations, parsed to a list of floats."""

    def seconds(text: str) -> list[float]:
        return [float(s) for s in text.split(",") if s]

    default = ",".join(f"{s:g}" for s in DEFAULT_SECONDS)
    p.add_argument("--seconds", type=seconds, default=default, help=help)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        prog="python -m speechattn.bench corpus", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, required=True, help="corpus root (must not exist)")
    p.add_argument("--utterances", type=int, required=True)
    per_speaker = f"default: utterances / {UTTERANCES_PER_SPEAKER}"
    p.add_argument("--speakers", type=int, default=None, help=per_speaker)
    p.add_argument("--chapters", type=int, default=2, help="per speaker")
    p.add_argument("--split", default="train-clean-360")
    add_seconds_argument(p, "durations of the source files, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy", action="store_true", help="copies instead of hard links")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = make_scale_corpus(
        args.out,
        args.utterances,
        args.speakers,
        args.chapters,
        args.split,
        args.seconds,
        args.seed,
        args.copy,
        progress=True,
    )
    print(root)
