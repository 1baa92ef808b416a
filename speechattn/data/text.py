"""A small English sentence generator for the built-in corpus: hand-written templates filled
from the word lists in `speechattn/data/text/`. `pool_of(text)` assigns every sentence to the
"main" or the "heldout" pool, so held-out corpora get sentences the main corpus never uses."""

from __future__ import annotations

import re
import zlib
from functools import cache
from pathlib import Path

import numpy as np

TEXT_DIR = Path(__file__).resolve().parent / "text"

# Slots: {N}/{N2} noun, {Ns}/{Ns2} plural noun, {A}/{A2} adjective, {V}/{Vb}/{Vz} transitive verb
# past/base/third person, {I}/{I2}/{Ib}/{Iz} intransitive, {D} adverb, {P} place, {T} time
# phrase, {Name}/{Name2} given names, {Num} a number word, {Prep} a preposition.
TEMPLATES = (
    "{Name} {V} the {A} {N} {Prep} the {P}.",
    "The {A} {N} {I} {D} {Prep} the {P}.",
    "{T}, {Name} and {Name2} {V} {Num} {A} {Ns}.",
    "Did the {N} really {Vb} the {A} {N2}?",
    "We {V} the {Ns} before the {A} {N} {I}.",
    "{Name} said that the {N} {Vz} every {A} {N2} {Prep} the {P}.",
    "Why would anyone {Vb} a {A} {N} {T}?",
    "The {Ns} {I} {D}, but the {N} {I2} {Prep} the {P}.",
    "If you {Vb} the {N}, the {A} {Ns} will {Ib} {D}.",
    "Nobody knew why the {A} {N} {V} the {N2}.",
    "{Name} {I} {Prep} the {A} {P} {T}.",
    "There were {Num} {A} {Ns} {Prep} the {P}, and {Name} {V} them all.",
    "Please {Vb} the {A} {N} {Prep} the {P} {T}.",
    "My {N} {Vz} {Ns} {D} whenever the {P} is {A}.",
    "After the {N} {I}, {Name} {V} a {A} {N2} and {I2} {D}.",
    "How many {Ns} did {Name} {Vb} {T}?",
    "The {P} was {A} and {A2}, so we {I} {D}.",
    "{Name} told the {A} {N} that the {Ns} had {I}.",
    "I think the {A} {N} {Vz} more {Ns} than the {N2}.",
    "{T}, the {Ns} {V} the {N} and {I} {Prep} the {P}.",
    "Where did you {Vb} the {A} {Ns} that {Name} {V}?",
    "The {N} and the {N2} {I} together {Prep} the {A} {P}.",
    "Never {Vb} a {N} that {Vz} {D}.",
    "{Name} wondered whether the {Ns} would {Vb} the {A} {N}.",
)
NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve")
PREPOSITIONS = ("near", "behind", "beside", "under", "across", "inside", "outside", "above")
HELDOUT_SHARE = 5  # one sentence in 5 belongs to the held-out pool


# word list -> words per line: (singular, plural) nouns, (base, third person, past) verbs
LISTS = {
    "nouns": 2,
    "verbs": 3,
    "intransitive": 3,
    "adjectives": 1,
    "adverbs": 1,
    "names": 1,
    "places": 1,
    "times": 1,
}


@cache
def lexicon() -> dict[str, tuple]:
    """The word lists shipped in `speechattn/data/text/` by name (read once per process): a
    tuple of words per line where `LISTS` gives several, else the line itself."""
    out = {}
    for name, n in LISTS.items():
        path = TEXT_DIR / f"{name}.txt"
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("#")]
        if n > 1 and (bad := [ln for ln in lines if len(ln.split()) != n]):
            raise ValueError(f"{path}: expected {n} words per line, found {bad[0]!r}")
        out[name] = tuple(tuple(ln.split()) if n > 1 else ln for ln in lines)
    return out


def _pick(rng: np.random.Generator, items: tuple, k: int = 1) -> list:
    return [items[i] for i in rng.choice(len(items), size=k, replace=False)]


def sentence(rng: np.random.Generator) -> str:
    """One sentence from a random template."""
    template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    lx = lexicon()
    (n1, n2) = _pick(rng, lx["nouns"], 2)
    (v,) = _pick(rng, lx["verbs"])
    (i1, i2) = _pick(rng, lx["intransitive"], 2)
    (a1, a2) = _pick(rng, lx["adjectives"], 2)
    (name1, name2) = _pick(rng, lx["names"], 2)
    slots = {
        "N": n1[0],
        "N2": n2[0],
        "Ns": n1[1],
        "Ns2": n2[1],
        "A": a1,
        "A2": a2,
        "V": v[2],
        "Vb": v[0],
        "Vz": v[1],
        "I": i1[2],
        "I2": i2[2],
        "Ib": i1[0],
        "Iz": i1[1],
        "D": _pick(rng, lx["adverbs"])[0],
        "P": _pick(rng, lx["places"])[0],
        "T": _pick(rng, lx["times"])[0],
        "Name": name1,
        "Name2": name2,
        "Num": _pick(rng, NUMBERS)[0],
        "Prep": _pick(rng, PREPOSITIONS)[0],
    }
    text = template.format(**slots)
    text = re.sub(r"\b([Aa]) (?=[aeiouAEIOU])", r"\1n ", text)  # a apple -> an apple
    return text[0].upper() + text[1:]


def utterance_text(rng: np.random.Generator, min_words: int, max_words: int) -> str:
    """One or more sentences with `min_words` to `max_words` words in total (best effort)."""
    for _ in range(50):
        parts: list[str] = []
        while (words := sum(len(p.split()) for p in parts)) < min_words:
            parts.append(sentence(rng))
        if words <= max_words:
            return " ".join(parts)
    return " ".join(parts)


def pool_of(text: str) -> str:
    """`"heldout"` or `"main"`: a fixed, content-based partition of all possible sentences."""
    return "heldout" if zlib.crc32(text.encode("utf-8")) % HELDOUT_SHARE == 0 else "main"


def normalise_transcript(text: str) -> str:
    """LibriSpeech style: upper case, letters, apostrophes and single spaces only."""
    text = re.sub(r"[^A-Za-z' ]+", " ", text).upper()
    return " ".join(text.split())
