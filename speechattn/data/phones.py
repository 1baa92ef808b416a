"""The built-in corpus's phone set, silence (`sil`, id 0) plus the 39 ARPAbet phonemes of the
CMU dictionary, and the map onto it of the IPA phonemes eSpeak NG's English accents produce
(each to the phoneme it realises: `ɒ` and `ɑː` -> AA, flap `ɾ` -> T, Scottish `ʍ` -> W, ...)."""

from __future__ import annotations

import unicodedata

SILENCE = "sil"
PHONE_SET: tuple[str, ...] = (SILENCE, "AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH",
    "EH", "ER", "EY", "F", "G", "HH", "IH", "IY", "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P",
    "R", "S", "SH", "T", "TH", "UH", "UW", "V", "W", "Y", "Z", "ZH")  # fmt: skip
PHONE_ID = {p: i for i, p in enumerate(PHONE_SET)}

# eSpeak IPA name (stress marks removed) -> ARPAbet class
IPA_TO_PHONE: dict[str, str] = {
    "": SILENCE, "_": SILENCE,
    # vowels
    "ɑ": "AA", "ɑː": "AA", "ɒ": "AA", "aː": "AA", "a:": "AA", "aa": "AA", "ɑə": "AA", "ɑːɹ": "AA",
    "ɑɹ": "AA",
    "æ": "AE", "a": "AE",
    "ʌ": "AH", "ə": "AH", "ɐ": "AH", "ɜ": "AH", "ɵ": "AH",
    "ɔ": "AO", "ɔː": "AO", "ɔːɹ": "AO", "ɔɹ": "AO", "oə": "AO", "ɔə": "AO", "oːɹ": "AO",
    "aʊ": "AW", "æʊ": "AW", "ʌʉ": "AW", "ɐʊ": "AW",
    "aɪ": "AY", "aɪə": "AY", "aɪɚ": "AY", "ʌɪ": "AY", "ɑɪ": "AY", "ɐɪ": "AY",
    "ɛ": "EH", "e": "EH", "eə": "EH", "ɛə": "EH", "ɛɹ": "EH", "ɛː": "EH", "eɹ": "EH",
    "ɚ": "ER", "ɜː": "ER", "ɝ": "ER", "əɹ": "ER", "ʌɹ": "ER", "əɪ": "ER", "ɜːɹ": "ER",
    "eɪ": "EY", "eː": "EY", "ei": "EY",
    "ɪ": "IH", "ᵻ": "IH", "iə": "IH", "ɪə": "IH", "ɪɹ": "IH", "ɪː": "IH",
    "i": "IY", "iː": "IY", "i:": "IY",
    "oʊ": "OW", "əʊ": "OW", "oː": "OW", "ʌʊ": "OW", "o": "OW", "oʊɹ": "OW",
    "ɔɪ": "OY", "oɪ": "OY",
    "ʊ": "UH", "ʊə": "UH", "ʊɹ": "UH",
    "u": "UW", "uː": "UW", "ʉ": "UW", "ʉː": "UW", "əu": "UW", "ju": "UW",
    # consonants
    "b": "B", "tʃ": "CH", "d": "D", "ð": "DH", "d̪": "DH", "f": "F", "ɡ": "G", "g": "G",
    "h": "HH", "ɦ": "HH", "x": "HH", "dʒ": "JH", "k": "K", "l": "L", "əl": "L", "l̩": "L",
    "ɫ": "L", "m": "M", "m̩": "M", "n": "N", "n̩": "N", "ŋ": "NG", "p": "P", "ɹ": "R", "r": "R",
    "ɾ": "T", "ʔ": "T", "s": "S", "ʃ": "SH", "t": "T", "θ": "TH", "t̪": "TH", "v": "V", "w": "W",
    "ʍ": "W", "j": "Y", "ʲ": "Y", "z": "Z", "ʒ": "ZH",
}  # fmt: skip

STRESS = str.maketrans("", "", "ˈˌ")


def ipa_to_phone(name: str) -> str:
    """ARPAbet class for one eSpeak phoneme name (IPA, stress marks allowed): unknown names
    fall back to the name without length marks, tie bars or diacritics, then to its longest
    known prefix; `KeyError` naming the symbol when nothing matches."""
    name = name.translate(STRESS).strip()
    decomposed = unicodedata.normalize("NFD", name)
    simple = "".join(c for c in decomposed if not unicodedata.combining(c) and c not in "ːˑ͡‿")
    for key in (name, simple, *(simple[:end] for end in range(len(simple) - 1, 0, -1))):
        if key in IPA_TO_PHONE:
            return IPA_TO_PHONE[key]
    raise KeyError(f"eSpeak phoneme {name!r} has no class in the phone set; add it to IPA_TO_PHONE")


def phone_id(name: str) -> int:
    """Class id (line number in `phone_set.txt`) for one eSpeak phoneme name."""
    return PHONE_ID[ipa_to_phone(name)]
