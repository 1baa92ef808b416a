"""Convert the built-in corpus into the folder layouts of s3prl's SUPERB tasks.

    python -m speechattn.superb.prepare --task speech_commands|voxceleb1|ctc|all
                                        [--root CORPUS] [--out DIR] [--repeats 3]

A task folder is written into a temporary sibling and renamed into place (`atomic_folder`), with
`superb_data.json` last, so an interrupted conversion is never mistaken for a finished one.
Layouts and splits: docs/superb.md#data; audio is hard-linked from the corpus where possible.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import logging
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile as sf

from speechattn.data.audio import resample
from speechattn.data.espeak import Espeak, VoiceSettings, fresh_engine_pool
from speechattn.data.librispeech import (
    UTT_RE,
    read_alignments,
    read_phone_set,
    read_split_list,
    speaker_of,
)
from speechattn.data.phones import PHONE_SET, SILENCE
from speechattn.data.synth import ensure_embedded_corpus
from speechattn.errors import ConfigError, command_line_errors
from speechattn.utils import (
    atomic_folder,
    atomic_write_text,
    default_cache_root,
    progress_bar,
    track,
)

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when a task's layout changes: cached conversions are then redone
DATA_FILE = "superb_data.json"
TASKS = ("speech_commands", "voxceleb1", "ctc")
SAMPLE_RATE = 16000
COMMANDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
UNKNOWN_WORDS = 10  # distinct `_unknown_` words, the corpus's most frequent non-command words
DEV_EVERY = 8  # every 8th training utterance of a speaker is dev (voxceleb1, ctc)
NOISE_SECONDS = 10.0


def default_out(root: Path, task: str) -> Path:
    """Where `python -m speechattn.superb` finds `task`'s data made from corpus `root`."""
    return default_cache_root() / "superb" / f"v{LAYOUT_VERSION}-{Path(root).name}" / task


def is_prepared(folder: Path, task: str) -> bool:
    """True when `folder` holds a finished conversion for `task` (its `superb_data.json`)."""
    try:
        info = json.loads((Path(folder) / DATA_FILE).read_text())
    except (OSError, ValueError):
        return False
    return info.get("task") == task and info.get("layout_version") == LAYOUT_VERSION


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)


def _corpus_utterances(root: Path) -> dict[str, Path]:
    """utt-id -> audio path of every utterance under `root/<split>/<spk>/<chapter>/`."""
    found = {p.stem: p for p in sorted(root.glob("*/*/*/*.flac")) if UTT_RE.match(p.stem)}
    if not found:
        raise ConfigError(f"--root {root}: no <split>/<speaker>/<chapter>/*.flac utterances found")
    return found


def _splits(root: Path) -> dict[str, str]:
    """utt-id -> "train" | "dev" | "test" from the corpus's split lists (every DEV_EVERY-th
    training utterance of each speaker becomes dev)."""
    split = {u: "test" for u in read_split_list(root / "test_split.txt")}
    per_speaker: dict[str, int] = Counter()
    for utt in sorted(read_split_list(root / "train_split.txt")):
        k = per_speaker[speaker_of(utt)]
        per_speaker[speaker_of(utt)] += 1
        split[utt] = "dev" if k % DEV_EVERY == DEV_EVERY - 1 else "train"
    return split


def speech_commands_split(name: str, max_per_class: int = 2**27 - 1) -> str:
    """The split the Speech Commands convention (which s3prl's `split_dataset` applies) puts a
    speaker name in: the sha1 of the name, as a percentage, < 10 dev, < 20 test, else train."""
    digest = int(hashlib.sha1(name.encode("utf-8")).hexdigest(), 16)
    percentage = (digest % (max_per_class + 1)) * (100.0 / max_per_class)
    return "dev" if percentage < 10 else "test" if percentage < 20 else "train"


def _speaker_name(speaker_id: str, split: str) -> str:
    """A file-name speaker prefix for `speaker_id` that s3prl's hash split puts in `split`."""
    for k in range(10_000):
        name = f"{int(speaker_id):04x}{k:04x}"
        if speech_commands_split(name) == split:
            return name
    raise AssertionError("no name found")  # each try lands in train/dev with p = 0.8/0.1


def _clip(audio: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Centre a word (with a little random offset) in a 1 s clip; longer words are cut."""
    out = np.zeros(SAMPLE_RATE, np.float32)
    audio = audio[:SAMPLE_RATE]
    start = int(rng.integers(0, SAMPLE_RATE - len(audio) + 1))
    out[start : start + len(audio)] = audio
    return out


def _noise(rng: np.random.Generator, seconds: float, colour: float, level_db: float) -> np.ndarray:
    """Coloured noise (power ~ 1/f^colour) at `level_db` dBFS RMS."""
    n = int(seconds * SAMPLE_RATE)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.maximum(np.fft.rfftfreq(n, 1 / SAMPLE_RATE), 20.0)
    noise = np.fft.irfft(spectrum / freqs ** (colour / 2), n)
    noise *= 10 ** (level_db / 20) / (np.sqrt(np.mean(noise**2)) + 1e-12)
    return np.clip(noise, -1, 1).astype(np.float32)


def prepare_speech_commands(root: Path, out: Path, repeats: int = 3, seed: int = 0) -> dict:
    """Keyword-spotting layout in `out` from corpus `root`: `train/<word>/<name>_nohash_<k>.wav`
    1 s clips of the commands and `_unknown_` words in the corpus speakers' eSpeak voices,
    `train/_background_noise_/`, and `test/<class>/` of held-out speakers. Spoken in a fresh
    process, so the words sound the same whatever this process spoke before."""
    with fresh_engine_pool(1, __name__) as pool:
        return pool.apply(_speak_keywords, (root, out, repeats, seed))


def _speak_keywords(root: Path, out: Path, repeats: int, seed: int) -> dict:
    speakers = json.loads((root / "speakers.json").read_text())
    ids = sorted(speakers)
    if len(ids) < 3:
        raise ConfigError(
            f"--root {root}: keyword spotting needs 3 speakers or more, found {len(ids)}"
        )
    n_held = max(1, len(ids) // 6)  # speakers for dev and for test each
    role = {s: "test" for s in ids[:n_held]} | {s: "dev" for s in ids[n_held : 2 * n_held]}
    words = Counter(
        w.lower()
        for path in root.glob("*/*/*/*.trans.txt")
        for line in path.read_text().splitlines()
        for w in line.split()[1:]
    )
    others = [w for w, _ in words.most_common() if w not in COMMANDS and w.isalpha()]
    unknown = others[:UNKNOWN_WORDS]
    engine = Espeak.get()
    rng = np.random.default_rng([seed, 2718])
    counts: Counter = Counter()
    with progress_bar(len(ids), "speaking keywords") as advance:
        for spk in ids:
            split = role.get(spk, "train")
            name = _speaker_name(spk, "dev" if split == "dev" else "train")
            base = out / ("test" if split == "test" else "train")
            voice = speakers[spk]
            for word in [*COMMANDS * repeats, *unknown]:
                settings = VoiceSettings(
                    voice=voice["voice"],
                    rate=int(voice["rate"] * rng.uniform(0.9, 1.1)),
                    pitch=int(np.clip(voice["pitch"] + rng.integers(-4, 5), 0, 100)),
                    pitch_range=int(voice["pitch_range"]),
                )
                raw, _ = engine.synthesize(word, settings)
                audio = resample(raw.astype(np.float32) / 32768.0, engine.sample_rate)
                audio *= 10 ** ((voice["gain_db"] + rng.uniform(-3, 3)) / 20)
                clip = _clip(audio, rng) + _noise(rng, 1.0, 0.0, -55 + rng.uniform(-5, 5))
                k = counts[(spk, word)]
                counts[(spk, word)] += 1
                # any word outside the 10 commands: s3prl maps its folder to _unknown_
                folder = word if word in COMMANDS or split != "test" else "_unknown_"
                path = base / folder / f"{name}_nohash_{k}.wav"
                path.parent.mkdir(parents=True, exist_ok=True)
                sf.write(path, np.clip(clip, -1, 1), SAMPLE_RATE, subtype="PCM_16")
            advance()
    noise_dir = out / "train" / "_background_noise_"
    noise_dir.mkdir(parents=True, exist_ok=True)
    for i, (colour, level) in enumerate([(0.0, -30), (1.0, -25), (2.0, -28), (1.0, -40)]):
        noise = _noise(rng, NOISE_SECONDS, colour, level)
        sf.write(noise_dir / f"noise_{i}.wav", noise, SAMPLE_RATE)
    silence = out / "test" / "_silence_"
    silence.mkdir(parents=True, exist_ok=True)
    for i in range(max(2, repeats * n_held)):
        level = rng.uniform(-45, -25)
        noise = _noise(rng, 1.0, float(rng.uniform(0, 2)), level)  # draws the colour, then noise
        sf.write(silence / f"silence_{i}.wav", noise, SAMPLE_RATE)
    return {
        "paths": {
            "downstream_expert.datarc.speech_commands_root": str(out / "train"),
            "downstream_expert.datarc.speech_commands_test_root": str(out / "test"),
        },
        "speakers": {"train": len(ids) - 2 * n_held, "dev": n_held, "test": n_held},
        "unknown_words": unknown,
        "repeats": repeats,
    }


def prepare_voxceleb1(root: Path, out: Path) -> dict:
    """Speaker-identification layout in `out` from corpus `root`: `vox1/wav/id1XXXX/<chapter>/
    <utt>.flac` (the i-th speaker is id(10001 + i)) and `veri_test_class.txt` ("1|2|3 path")."""
    utterances = _corpus_utterances(root)
    split = _splits(root)
    speakers = sorted({speaker_of(u) for u in utterances})
    vox_id = {s: f"id{10001 + i}" for i, s in enumerate(speakers)}
    index = {"train": 1, "dev": 2, "test": 3}
    lines = []
    for utt, path in track(utterances.items(), "linking voxceleb1 audio"):
        if utt not in split:
            continue
        relative = f"{vox_id[speaker_of(utt)]}/{path.parent.name}/{path.name}"
        _link(path, out / "vox1" / "wav" / relative)
        lines.append(f"{index[split[utt]]} {relative}")
    atomic_write_text(out / "veri_test_class.txt", "\n".join(lines) + "\n")
    return {
        "paths": {
            "downstream_expert.datarc.file_path": str(out),
            "downstream_expert.datarc.meta_data": str(out / "veri_test_class.txt"),
        },
        "speakers": len(speakers),
        "utterances": dict(Counter(split[u] for u in utterances if u in split)),
    }


def phoneme_sequence(labels: np.ndarray, phone_set: list[str]) -> list[str]:
    """Frame labels (T,) -> the phonemes spoken: runs merged, silence dropped."""
    runs = [int(x) for i, x in enumerate(labels) if i == 0 or x != labels[i - 1]]
    return [phone_set[x] for x in runs if phone_set[x] != SILENCE]


def prepare_ctc(root: Path, out: Path) -> dict:
    """s3prl `libriphone` layout in `out` from corpus `root`: `<split>.csv`, `lexicon.txt` whose
    "word" is an utterance id spelled as its alignment's phonemes, `phoneme.txt`."""
    utterances = _corpus_utterances(root)
    split = _splits(root)
    phone_file = root / "phone_set.txt"
    phone_set = read_phone_set(phone_file) if phone_file.is_file() else list(PHONE_SET)
    labels = read_alignments(root / "converted_aligned_phones.txt", phone_set, wanted=set(split))
    rows: dict[str, list[tuple[str, str]]] = {"train": [], "dev": [], "test": []}
    lexicon = []
    for utt, path in track(utterances.items(), "linking phoneme-recognition audio"):
        if utt not in split or utt not in labels:
            continue
        phonemes = phoneme_sequence(labels[utt], phone_set)
        if not phonemes:
            continue
        target = out / "audio" / path.name
        _link(path, target)
        rows[split[utt]].append((str(target), utt))
        lexicon.append(f"{utt} {' '.join(phonemes)}")
    for name, items in rows.items():
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows([("wav_path", "transcription"), *items])
        atomic_write_text(out / f"{name}.csv", buffer.getvalue())
    atomic_write_text(out / "lexicon.txt", "\n".join(lexicon) + "\n")
    vocabulary = [p for p in phone_set if p != SILENCE]
    atomic_write_text(out / "phoneme.txt", "\n".join(vocabulary) + "\n")
    return {
        "paths": {
            "downstream_expert.corpus.csv_dir": str(out),
            "downstream_expert.corpus.lexicon": [str(out / "lexicon.txt")],
            "downstream_expert.text.vocab_file": str(out / "phoneme.txt"),
        },
        "utterances": {k: len(v) for k, v in rows.items()},
        "phonemes": len(vocabulary),
    }


PREPARE: dict[str, Callable[..., dict]] = {
    "speech_commands": prepare_speech_commands,
    "voxceleb1": prepare_voxceleb1,
    "ctc": prepare_ctc,
}


def prepare(task: str, root: str | Path, out: str | Path, repeats: int = 3) -> Path:
    """Convert corpus `root` into `task`'s layout at `out`, reused when finished; returns `out`."""
    if task not in PREPARE:
        raise ConfigError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    root, out = Path(root).expanduser().resolve(), Path(out).expanduser().resolve()
    if is_prepared(out, task):
        return out
    if out.exists() and any(out.iterdir()):
        raise ConfigError(
            f"--out {out}: exists without a finished {DATA_FILE}; remove it or choose another folder"
        )
    log.info("converting %s for %s into %s", root, task, out)
    with atomic_folder(out) as tmp:  # an empty `out` is replaced
        kwargs = {"repeats": repeats} if task == "speech_commands" else {}
        info = PREPARE[task](root, tmp, **kwargs)
        paths = {k: _moved(v, tmp, out) for k, v in info.pop("paths").items()}
        record = {
            "task": task,
            "layout_version": LAYOUT_VERSION,
            "corpus": str(root),
            "config": paths,
            **info,
        }
        if task == "ctc":  # csv rows name the audio by absolute path
            for name in ("train", "dev", "test"):
                csv_path = tmp / f"{name}.csv"
                csv_path.write_text(csv_path.read_text().replace(str(tmp), str(out)))
        atomic_write_text(tmp / DATA_FILE, json.dumps(record, indent=2) + "\n")
    log.info("prepared %s in %s", task, out)
    return out


def _moved(value, tmp: Path, out: Path):
    if isinstance(value, list):
        return [_moved(v, tmp, out) for v in value]
    return re.sub(rf"^{re.escape(str(tmp))}", str(out), value)


def data_config(folder: str | Path, task: str) -> dict[str, object]:
    """Dotted config keys -> paths that point `task`'s s3prl config at the prepared `folder`."""
    folder = Path(folder).expanduser()
    if not is_prepared(folder, task):
        raise ConfigError(
            f"--data {folder}: no prepared {task} data ({DATA_FILE} missing or for another "
            f"task); run python -m speechattn.superb.prepare --task {task} --out {folder}"
        )
    return json.loads((folder / DATA_FILE).read_text())["config"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechattn.superb.prepare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--task", required=True, choices=[*TASKS, "all"])
    parser.add_argument("--root", type=Path, default=None, help="corpus (default: built-in)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: the cache folder superb reads)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="keyword clips per word and speaker")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = args.root or ensure_embedded_corpus()
    tasks = TASKS if args.task == "all" else (args.task,)
    if args.out is not None and len(tasks) > 1:
        raise ConfigError("--out names one task's folder: use it with one --task")
    for task in tasks:
        out = prepare(task, root, args.out or default_out(root, task), args.repeats)
        print(f"{task}: {out}")


if __name__ == "__main__":
    with command_line_errors(prog="python -m speechattn.superb.prepare"):
        main()
