"""Minimal ctypes binding to eSpeak NG (shipped by the `espeakng-loader` wheel).

eSpeak NG keeps global state and is not thread-safe: one `Espeak` per process (`Espeak.get()`);
parallelise with processes (`fresh_engine_pool`).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import threading
from dataclasses import dataclass

import numpy as np

from speechattn.errors import ConfigError, DependencyError
from speechattn.utils import init_pool_worker

# speak_lib.h constants
AUDIO_OUTPUT_SYNCHRONOUS, POS_CHARACTER, CHARS_UTF8 = 2, 1, 1
INITIALIZE_PHONEME_EVENTS, INITIALIZE_PHONEME_IPA, INITIALIZE_DONT_EXIT = 0x0001, 0x0002, 0x8000
EVENT_LIST_TERMINATED, EVENT_PHONEME = 0, 7
PARAM_RATE, PARAM_VOLUME, PARAM_PITCH, PARAM_RANGE = 1, 2, 3, 4


class _Event(ctypes.Structure):
    """`espeak_EVENT`; `id` is a union whose 8-byte `string` member holds the phoneme name."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_Callback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event)
)


@dataclass(frozen=True)
class VoiceSettings:
    """eSpeak voice name (`"en-us+m3"`: language + variant) and prosody parameters."""

    voice: str
    rate: int = 175  # words per minute (80..450)
    pitch: int = 50  # base pitch, 0..100
    pitch_range: int = 50  # intonation range, 0..100
    volume: int = 100


class Espeak:
    """Per-process eSpeak NG engine (use `Espeak.get()`)."""

    _instance: Espeak | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        c = ctypes
        for name, argtypes in (
            ("espeak_Initialize", [c.c_int, c.c_int, c.c_char_p, c.c_int]),
            ("espeak_SetVoiceByName", [c.c_char_p]),
            ("espeak_SetParameter", [c.c_int, c.c_int, c.c_int]),
            (
                "espeak_Synth",
                [
                    c.c_void_p,
                    c.c_size_t,
                    c.c_uint,
                    c.c_int,
                    c.c_uint,
                    c.c_uint,
                    c.c_void_p,
                    c.c_void_p,
                ],
            ),
        ):
            function = getattr(self.lib, name)
            function.argtypes, function.restype = argtypes, c.c_int
        flags = INITIALIZE_PHONEME_EVENTS | INITIALIZE_PHONEME_IPA | INITIALIZE_DONT_EXIT
        data_path = espeakng_loader.get_data_path().encode()
        rate = self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path, flags)
        if rate <= 0:
            msg = f"espeak_Initialize failed (returned {rate}); data path {data_path!r}"
            raise DependencyError(msg)
        self.sample_rate = int(rate)
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[int, str]] = []
        self._callback = _Callback(self._on_synth)  # keep a reference: C holds the pointer
        self.lib.espeak_SetSynthCallback(self._callback)

    @classmethod
    def get(cls) -> Espeak:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _on_synth(self, wav, num_samples: int, events) -> int:
        if num_samples > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
        i = 0
        while (event := events[i]).type != EVENT_LIST_TERMINATED:
            if event.type == EVENT_PHONEME:
                name = event.id.decode("utf-8", errors="replace").rstrip("\x00")
                self._events.append((int(event.sample), name))
            i += 1
        return 0  # 0 = continue synthesis

    def synthesize(
        self, text: str, settings: VoiceSettings
    ) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """Speak `text` -> int16 audio (N,) at `sample_rate` (22050 Hz) and [(start sample, IPA
        phoneme name)], "" marking a pause."""
        with self._lock:
            if self.lib.espeak_SetVoiceByName(settings.voice.encode()) != 0:
                raise ConfigError(f"eSpeak NG has no voice {settings.voice!r}")
            params = {
                PARAM_RATE: settings.rate,
                PARAM_PITCH: settings.pitch,
                PARAM_RANGE: settings.pitch_range,
                PARAM_VOLUME: settings.volume,
            }
            for param, value in params.items():
                self.lib.espeak_SetParameter(param, int(value), 0)
            self._chunks, self._events = [], []
            buf = text.encode("utf-8") + b"\x00"
            err = self.lib.espeak_Synth(buf, len(buf), 0, POS_CHARACTER, 0, CHARS_UTF8, None, None)
            if err != 0:
                raise DependencyError(f"espeak_Synth failed with error {err} for text {text!r}")
            audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            return audio.astype(np.int16, copy=False), list(self._events)


def fresh_engine_pool(workers: int, preload: str) -> mp.pool.Pool:
    """A process pool whose every task runs in a new process with an unused engine.

    eSpeak NG carries state from one synthesis to the next inside a process (its wave
    generator's phase and pitch flutter; neither `espeak_Terminate` + `espeak_Initialize` nor a
    random seed resets it), so a task must not share its process. Each worker runs one task,
    forked from this process while it has never loaded the library, else from a server process
    that never speaks (`preload`: the tasks' module), or spawned where neither is available.
    """
    methods = mp.get_all_start_methods()
    if Espeak._instance is None and "fork" in methods:
        context = mp.get_context("fork")
    elif "forkserver" in methods:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload([preload])
    else:
        context = mp.get_context("spawn")
    return context.Pool(workers, initializer=init_pool_worker, maxtasksperchild=1)
