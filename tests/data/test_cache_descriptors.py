"""Open descriptors stay bounded whatever the corpus size: a process limited to 128 files
reads every utterance of a cache of more than 128 shards, directly and through a DataLoader
with 2 workers (1563 shards stopped at batch 31 under `ulimit -n 1024`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

SPLIT = "train-clean-360"

SCRIPT = """
import errno, json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from torch.utils.data import DataLoader
from speechattn.data.cache import ExtractionSettings, open_split
from speechattn.data.datasets import FeatureDataset, collate
from speechattn.data.features import Normalizer

root, cache = sys.argv[1], sys.argv[2]
def open_fds():
    return len(os.listdir("/proc/self/fd"))
def store():
    return open_split(root, "SPLIT_NAME", ExtractionSettings(), cache, workers=1, shard_size=1,
                      progress=False, max_open_shards=32)
s = store()  # cold: extracts every shard under the limit
base, peak = open_fds(), 0
for i in range(len(s)):
    s.raw(i)
    peak = max(peak, open_fds())
s = store()  # warm
loader = DataLoader(FeatureDataset(s, range(len(s)), Normalizer.identity(s.feature_dim)),
                    batch_size=8, shuffle=True, collate_fn=collate, num_workers=2)
served = [u for batch in loader for u in batch["utt_ids"]]
s.max_open_shards = 10_000  # control: without the LRU bound the same reads run out of files
try:
    for i in range(len(s)):
        s.raw(i)
    control = "no error"
except OSError as e:
    control = errno.errorcode[e.errno]
s.max_open_shards = 32
s.raw(0)  # closes all but 32
intact = not s.check(verify=True)  # running out of descriptors damaged nothing
print(json.dumps({"intact": intact, "shards": s.num_shards, "utterances": len(s), "base": base, "peak": peak,
                  "served": sorted(served) == sorted(s.utt_ids), "control": control}))
""".replace("SPLIT_NAME", SPLIT)


def write_corpus(root: Path, speakers: int, chapters: int, per_chapter: int) -> Path:
    """A LibriSpeech-layout split of short (0.1 s) noise utterances with transcripts."""
    rng = np.random.default_rng(0)
    for s in range(speakers):
        for c in range(chapters):
            spk, ch = str(100 + s), str(1000 + c)
            folder = root / SPLIT / spk / ch
            folder.mkdir(parents=True)
            lines = []
            for u in range(per_chapter):
                utt = f"{spk}-{ch}-{u:04d}"
                sf.write(folder / f"{utt}.flac", 0.1 * rng.standard_normal(1600), 16000)
                lines.append(f"{utt} WORD\n")
            (folder / f"{spk}-{ch}.trans.txt").write_text("".join(lines))
    return root


@pytest.mark.slow
def test_a_cache_of_more_shards_than_the_descriptor_limit_is_served(tmp_path):
    root = write_corpus(tmp_path / "corpus", speakers=5, chapters=3, per_chapter=12)  # 180
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["shards"] == r["utterances"] == 180  # shard_size 1: one shard per utterance
    assert r["peak"] <= r["base"] + 32  # max_open_shards
    assert r["served"]  # every utterance, once, through 2 worker processes
    assert r["control"] == "EMFILE"  # the limit is real: unbounded, the reads fail
    assert r["intact"]  # ... and a failed open is not mistaken for a damaged shard
