"""`target: pitch`: is the speaker's voice in the lower or the upper half of the corpus's
pitches? One label per utterance, read from the built-in corpus's metadata.

The worked example of docs/extending.md ("add a downstream task"): this file and
`conf/task/pitch_utterance.yaml` are all it takes. The built-in corpus (`speechattn.data.synth`)
records each speaker's eSpeak base pitch in `<corpus root>/speakers.json`; the speakers sorted
by (pitch, id) are split in two halves, class 0 the lower one, so the classes are balanced
whatever the pitches drawn. Corpora without that file (LibriSpeech) are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

from speechattn.data.librispeech import speaker_of
from speechattn.errors import ConfigError
from speechattn.tasks.downstream.labels import LabelSource, register

METADATA = "speakers.json"  # written by speechattn.data.synth: speaker id -> voice parameters


@register("pitch")
class PitchLabels(LabelSource):
    def num_classes(self) -> int | None:
        return 2  # lower half, upper half

    def utterance_label(self, utt_id: str) -> int:
        classes = self._classes()
        speaker = speaker_of(utt_id)
        if speaker not in classes:
            raise ConfigError(f"utterance {utt_id}: speaker {speaker} is not in {self._path()}")
        return classes[speaker]

    def _path(self) -> Path:
        if self.datamodule is None:
            raise ConfigError("target=pitch reads the corpus metadata: bind it to a data module")
        return Path(self.datamodule.root) / METADATA

    def _classes(self) -> dict[str, int]:
        """speaker id -> 0 (lower half of the pitches) or 1 (upper half), read once."""
        if not hasattr(self, "_by_speaker"):
            path = self._path()
            if not path.is_file():
                raise ConfigError(
                    f"target=pitch needs {path}, the speaker metadata of the built-in corpus "
                    f"(data=embedded); this corpus has none"
                )
            speakers = json.loads(path.read_text())
            order = sorted(speakers, key=lambda s: (speakers[s]["pitch"], s))
            self._by_speaker = {s: int(k >= len(order) // 2) for k, s in enumerate(order)}
        return self._by_speaker
