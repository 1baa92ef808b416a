"""ABX discriminability (docs/abx.md): the fast implementation against a brute-force reference
written from the definition, answers known in advance, the frame mapping, and the job."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from speechattn.tasks.abx import abx_score, frame_span, triphone_items

# ----------------------------------------------------------------------------- reference


def ref_items(phones, speakers, features, factor):
    """Every triphone as (context, center, speaker, frames (n, D)), from plain loops."""
    out = []
    for u, labels in enumerate(phones):
        runs = []  # [label, start, end)
        for t, p in enumerate(labels):
            if runs and runs[-1][0] == p:
                runs[-1][2] = t + 1
            else:
                runs.append([p, t, t + 1])
        for prev, mid, nxt in zip(runs, runs[1:], runs[2:]):
            if min(prev[0], mid[0], nxt[0]) < 0:
                continue
            start, end = prev[1], nxt[2]
            # representation frame j covers label frames factor*j ...: in when its middle one is
            middle = (factor - 1) // 2
            js = [j for j in range(len(features[u])) if start <= factor * j + middle < end]
            if js:
                out.append(((prev[0], nxt[0]), mid[0], speakers[u], features[u][js].double()))
    return out


def ref_frame_distance(x, y, distance):
    if torch.equal(x, y):
        return 0.0
    nx, ny = float(x.norm()), float(y.norm())
    cos = float(x @ y) / (nx * ny) if nx > 0 and ny > 0 else 0.0
    cos = min(1.0, max(-1.0, cos))
    return math.acos(cos) / math.pi if distance == "angular" else 1.0 - cos


def ref_dtw(x, y, distance):
    """Textbook DTW; among optimal paths the shortest; summed distance / path length."""
    n, m = len(x), len(y)
    best = {}
    for i in range(n):
        for j in range(m):
            d = ref_frame_distance(x[i], y[j], distance)
            before = [best[p] for p in ((i - 1, j), (i, j - 1), (i - 1, j - 1)) if p in best]
            cost, steps = min(before) if before else (0.0, 0)
            best[i, j] = (cost + d, steps + 1)
    cost, steps = best[n - 1, m - 1]
    return cost / steps


def ref_abx(items, distance="angular"):
    """(within, across) error rates: every triplet scored, cells averaged as Libri-light."""
    cache = {}

    def d(i, j):
        if (i, j) not in cache:
            cache[i, j] = ref_dtw(items[i][3], items[j][3], distance)
        return cache[i, j]

    cells = {"within": defaultdict(list), "across": defaultdict(list)}
    for x, a, b in itertools.product(range(len(items)), repeat=3):
        (cx, px, sx, _), (ca, pa, sa, _), (cb, pb, sb, _) = items[x], items[a], items[b]
        if not (cx == ca == cb and px == pa and pb != pa and sa == sb and a != x):
            continue
        dax, dbx = d(a, x), d(b, x)
        error = 1.0 if dax > dbx else 0.5 if dax == dbx else 0.0
        mode = "within" if sx == sa else "across"
        cells[mode][ca, sa, pa, pb, sx].append(error)
    out = []
    for mode in ("within", "across"):
        per_speaker = defaultdict(list)  # (speaker, a, b) <- contexts (and X speakers)
        for (_, s, pa, pb, _), errors in cells[mode].items():
            per_speaker[s, pa, pb].append(np.mean(errors))
        per_pair = defaultdict(list)
        for (_, pa, pb), errors in per_speaker.items():
            per_pair[pa, pb].append(np.mean(errors))
        out.append(np.mean([np.mean(e) for e in per_pair.values()]) if per_pair else None)
    return tuple(out)


# ----------------------------------------------------------------------------- fast


def fast_abx(phones, speakers, features, factor=1, distance="angular"):
    items = triphone_items(phones, speakers)
    lengths = np.array([len(f) for f in features])
    first, stop = frame_span(items.start, items.end, factor, lengths[items.utt])
    keep = stop > first
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return abx_score(
        torch.cat(features), offsets, items.subset(keep), first[keep], stop[keep], distance
    )


def generated(seed, speakers=3, utterances=4, runs=10, phones=4, dim=5, factor=1):
    """Random phone runs (1-5 frames, no two neighbours alike) and random features; one
    utterance per speaker has constant features (ties), one repeats another (equal items)."""
    g = np.random.default_rng(seed)
    labels, spk, feats = [], [], []
    for s in range(speakers):
        for u in range(utterances):
            seq = [int(g.integers(phones))]
            while len(seq) < runs:
                seq.append(int((seq[-1] + g.integers(1, phones)) % phones))
            lab = np.repeat(seq, g.integers(1, 6, size=runs))
            T = -(-len(lab) // factor)
            x = torch.from_numpy(g.normal(size=(T, dim))).float()
            if u == 0:
                x = torch.ones(T, dim)  # every item of it at the same distance from any X
            labels.append(lab)
            spk.append(s)
            feats.append(x)
        labels.append(labels[-1].copy())  # a repeat: items at distance 0 from each other
        spk.append(s)
        feats.append(feats[-1].clone())
    return labels, spk, feats


@pytest.mark.parametrize("seed,factor,distance", [(0, 1, "angular"), (1, 3, "angular"),
                                                  (2, 1, "cosine")])  # fmt: skip
def test_fast_equals_the_reference(seed, factor, distance):
    phones, speakers, features = generated(seed, factor=factor)
    score = fast_abx(phones, speakers, features, factor, distance)
    within, across = ref_abx(ref_items(phones, speakers, features, factor), distance)
    assert score.within == pytest.approx(within, abs=1e-12)
    assert score.across == pytest.approx(across, abs=1e-12)
    assert score.cells["within"] > 0 and score.triplets["across"] > score.triplets["within"]


def test_features_of_the_center_phone_give_no_error():
    phones, speakers, features = generated(3)
    onehot = [torch.eye(4)[torch.from_numpy(p)] for p in phones]
    score = fast_abx(phones, speakers, onehot)
    assert score.within == 0.0 and score.across == 0.0


def test_identical_features_give_chance():
    phones, speakers, features = generated(4)
    score = fast_abx(phones, speakers, [torch.ones(len(p), 3) for p in phones])
    assert score.within == 0.5 and score.across == 0.5


def test_speaker_dependent_codes_fail_across_speakers_only():
    """Each speaker codes the phones with its own random vectors: A, B, X of one speaker
    are told apart perfectly; an X of another speaker matches A's center only by chance."""
    phones, speakers, _ = generated(5, speakers=4, utterances=6)
    codes = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(0))  # (speaker, phone, D)
    features = [codes[s][torch.from_numpy(p)] for p, s in zip(phones, speakers, strict=True)]
    score = fast_abx(phones, speakers, features)
    assert score.within == 0.0
    assert 0.25 < score.across < 0.75


def test_items_are_runs_with_a_neighbour_on_each_side():
    labels = [np.array([0, 0, 1, 2, 2, 2, 1, -100, 3, 1, 2, 1])]
    items = triphone_items(labels, [7])
    got = list(zip(items.start, items.end, items.prev, items.center, items.next, strict=True))
    assert got == [(0, 6, 0, 1, 2), (2, 7, 1, 2, 1), (8, 11, 3, 1, 2), (9, 12, 1, 2, 1)]
    assert set(items.speaker) == {7} and set(items.utt) == {0}


def test_a_span_keeps_the_frames_whose_middle_label_frame_it_holds():
    start, end = np.array([0, 2, 5, 0, 3]), np.array([3, 5, 7, 9, 12])
    first, stop = frame_span(start, end, 3, np.full(5, 3))
    # frame j covers 3j..3j+2, middle 3j+1: [0,3) -> 0; [2,5) -> 1 (middle 4); [5,7) -> none;
    # [0,9) -> 0..2; [3,12) -> 1..3, capped at the 3 frames of the utterance
    assert list(zip(first, stop, strict=True)) == [(0, 1), (1, 2), (2, 2), (0, 3), (1, 3)]
    first, stop = frame_span(start, end, 1, np.full(5, 20))
    assert (first == start).all() and (stop == end).all()


# ----------------------------------------------------------------------------- the job


def abx_config(data, out, *overrides):
    from omegaconf import open_dict

    from speechattn.config import compose

    cfg = compose("abx", [
        f"data.root={data.root}", f"data.cache_dir={data.cache_dir}", "data.batch_size=4",
        "data.extract_workers=1", "data.shard_size=8", "data.progress=false", *overrides,
    ])  # fmt: skip
    with open_dict(cfg):
        cfg.output_dir = str(out)
    return cfg


def test_the_job_scores_mel_on_the_built_in_corpus(tiny_data_config, tmp_path):
    from speechattn.tasks.abx import run
    from speechattn.tasks.records import read_abx

    returned = run(abx_config(tiny_data_config, tmp_path, "upstream=mel", "split=dev"))
    record = read_abx(tmp_path / "abx.json")
    assert json.loads((tmp_path / "abx.json").read_text()) == returned
    assert record.attention == "mel" and record.frame_ms == 10 and record.split == "dev"
    assert [row["layer"] for row in record.layers] == [0]
    assert record.items["scored"] == record.items["total"] > 0
    across = record.errors("across")[0]
    assert 0 <= across < 0.5  # the log-mel features tell phones apart better than chance
    assert record.layers[0]["triplets"]["across"] > 0


@pytest.mark.parametrize("override,error,message", [
    ("data.alignments=missing_alignments.txt", "MissingFileError", "missing_alignments.txt does not exist"),
    ("data.alignments=null", "ConfigError", "data.alignments is null"),
    ("layer=1", "ConfigError", "layer=1 is out of range"),
    ("layer=weighted", "ConfigError", "layer=weighted"),
    ("distance=euclid", "ConfigError", "distance"),
])  # fmt: skip
def test_bad_settings_are_refused_before_any_extraction(
    tiny_data_config, tmp_path, override, error, message
):
    from speechattn.tasks.abx import run

    with pytest.raises(Exception, match=message) as caught:
        run(abx_config(tiny_data_config, tmp_path, "upstream=mel", override))
    assert type(caught.value).__name__ == error
    assert not (tmp_path / "abx.json").exists()


# ----------------------------------------------------------------------------- the report


def test_the_report_tables_and_plots_every_layer(tmp_path):
    from speechattn.report.build import make_report
    from speechattn.report.results import collect
    from speechattn.tasks.records import AbxRecord

    def record(attention, errors, created):
        layers = [{"layer": k, "within": w, "across": a} for k, (w, a) in enumerate(errors)]
        return AbxRecord(attention, None, attention, "test", "angular", 30.0, layers,
                         created=created)  # fmt: skip

    record("mel", [(0.114, 0.22)], "2026-01-01").write(tmp_path / "mel")
    record("full", [(0.5, 0.5)], "2026-01-01").write(tmp_path / "old")  # superseded below
    record("full", [(0.085, 0.196), (0.095, None)], "2026-01-02").write(tmp_path / "full")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "abx.json").write_text("{}")
    report = make_report(tmp_path)
    table = (tmp_path / "abx.md").read_text()
    assert "| L0 within | L0 across | L1 within | L1 across |" in table
    assert "| mel (no pretraining) | 11.40 | 22.00 | – | – |" in table
    assert "| full | **8.50** | **19.60** | **9.50** | – |" in table
    assert (tmp_path / "fig_abx_layers.png").stat().st_size > 0
    assert "fig_abx_layers.png" in (tmp_path / "README.md").read_text()
    assert any("broken" in note for note in report.notes)
    assert collect(tmp_path).superseded == [tmp_path / "old" / "abx.json"]
