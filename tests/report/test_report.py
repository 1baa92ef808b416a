"""The report from a partial results folder: gaps, never crashes."""

import csv
import json
from pathlib import Path

import pytest

from speechattn.report.__main__ import main
from speechattn.report.build import make_report
from speechattn.report.results import collect, read_bench, registry_order
from speechattn.tasks.records import TASKS, DownstreamResult, read_result


def fake_result(
    root: Path, variant: str, task: str, acc: float, created: str = "2024-01-01T00:00:00+00:00"
) -> Path:
    result = DownstreamResult(
        task=task,
        upstream="mel" if variant == "mel" else str(root / variant / "upstream.pt"),
        upstream_sha256=None if variant == "mel" else "ab" * 32,
        attention=variant,
        layer="last",
        dev_accuracy=acc,
        test_accuracy=acc,
        seed=0,
        code_version="test",
        split_sizes={"train": 10, "dev": 2, "test": 3},
        upstream_parameters=0 if variant == "mel" else 1234,
        frames_per_utterance=0.0 if variant == "mel" else 100.0,
        created=created,
    )
    return result.write(root / variant / task)


@pytest.fixture
def partial(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    for i, task in enumerate(TASKS):
        fake_result(root, "mel", task, 0.1 + 0.01 * i)
    for task in TASKS[:3]:
        fake_result(root, "full", task, 0.8)
    fake_result(root, "shared_qk", "phone_1hidden", 0.9)
    # An older duplicate (superseded) and two broken files.
    fake_result(root / "old", "full", "speaker_utterance", 0.2, created="2020-01-01T00:00:00+00:00")
    (root / "broken").mkdir()
    (root / "broken" / "result.json").write_text("{not json")
    (root / "incomplete").mkdir()
    (root / "incomplete" / "result.json").write_text(json.dumps({"task": "speaker_frame"}))
    return root


def test_result_json_round_trip(tmp_path: Path) -> None:
    path = fake_result(tmp_path, "full", "phone_2hidden", 0.5)
    data = json.loads(path.read_text())
    for key in (
        "task",
        "upstream",
        "upstream_sha256",
        "attention",
        "model_config",
        "pretraining_steps",
        "corpus",
        "split_sizes",
        "dev_accuracy",
        "test_accuracy",
        "seed",
        "code_version",
    ):
        assert key in data
    assert read_result(path) == DownstreamResult(**data)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{oops", "not a readable"),
        ("[]", "JSON object"),
        ('{"task": "x"}', "lacks required"),
        (None, "must be a number"),
    ],
)
def test_read_result_rejects_bad_files(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "result.json"
    if content is None:
        data = json.loads(fake_result(tmp_path, "full", "phone_1hidden", 0.5).read_text())
        data["test_accuracy"] = 1.5
        content = json.dumps(data)
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        read_result(path)
    assert str(path) in str(info.value)


def test_collect_keeps_newest_and_reports_problems(partial: Path) -> None:
    found = collect(partial)
    assert found.accuracy("full", "speaker_utterance") == 0.8  # the newer run wins
    assert len(found.superseded) == 1
    assert len(found.problems) == 2 and all("result.json" in p for p in found.problems)
    assert found.variants()[0] == "mel"
    assert found.accuracy("shared_qk", "speaker_frame") is None


def test_report_from_partial_results(partial: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    report = make_report(partial, out=out)
    for name in (
        "table1.md",
        "table1.csv",
        "table2.md",
        "table2.csv",
        "table2_reference.csv",
        "README.md",
    ):
        assert (out / name).is_file(), name
    if registry_order():  # keys attended come from the attention registry
        assert (out / "fig_accuracy_vs_keys.png").is_file()
    table2 = (out / "table2.md").read_text()
    assert "mel (no pretraining)" in table2
    assert "**0.9000**" in table2  # shared_qk is best on phone_1hidden
    assert "–" in table2  # gaps for the missing runs
    assert "0.9926" in table2  # the study's reference numbers
    rows = {row[0]: row for row in csv.reader(open(out / "table2.csv"))}
    assert rows["full"][4] == ""  # full has no phone_2hidden run: an empty cell
    assert float(rows["mel (no pretraining)"][1]) == pytest.approx(0.1)
    assert ("full", "phone_2hidden") in report.missing
    readme = (out / "README.md").read_text()
    assert "table2.md" in readme and "Missing runs" in readme
    assert any("fig_attention_maps" in n for n in report.notes)  # no upstream.pt: a note, no crash


def test_report_of_empty_folder(tmp_path: Path) -> None:
    report = make_report(tmp_path, out=tmp_path / "r")
    assert (tmp_path / "r" / "table2.md").is_file()
    assert not (tmp_path / "r" / "fig_accuracy_vs_keys.png").exists()
    assert report.missing  # every expected run is missing


def test_bench_json_is_read_tolerantly(tmp_path: Path) -> None:
    path = tmp_path / "attention.json"
    path.write_text(
        json.dumps(
            {
                "device": "cpu",
                "results": [
                    {"attention": "full", "seq_len": 256, "time_ms": 1.5, "peak_memory_mb": 10.0},
                    {"variant": "ldsa", "T": 256, "time_ms": 0.5},
                    {"bogus": True},
                ],
            }
        )
    )
    records, meta = read_bench(path)
    assert meta == {"device": "cpu"}
    assert [(r.variant, r.seq_len, r.time_ms, r.memory_mb) for r in records] == [
        ("full", 256, 1.5, 10.0),
        ("ldsa", 256, 0.5, None),
    ]


def test_cli(partial: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps([{"attention": "full", "seq_len": 128, "time_ms": 2.0}]))
    assert main([str(partial), "--out", str(tmp_path / "cli"), "--bench", str(bench)]) == 0
    table1 = (tmp_path / "cli" / "table1.md").read_text()
    assert "time ms (T=128)" in table1 and "2.0" in table1
    assert "wrote" in capsys.readouterr().out


def test_attention_maps_from_a_real_upstream(tmp_path: Path) -> None:
    """A pretrained run's upstream.pt + saved utterance give the every-head figure."""
    import torch

    from speechattn.data import Normalizer
    from speechattn.model.aalbert import aalbert
    from speechattn.model.upstream import save_upstream, upstream_state

    model = aalbert(feature_dim=8, dim=16, num_layers=2, num_heads=2, ffn_dim=32, attention="full")
    upstream = save_upstream(
        tmp_path / "pretrain" / "upstream.pt",
        upstream_state(
            model, Normalizer(torch.zeros(8), torch.ones(8)), {"n_mels": 8}, {"steps": 1}
        ),
    )
    root = tmp_path / "results"
    path = fake_result(root, "full", "speaker_utterance", 0.7)
    data = json.loads(path.read_text())
    data["upstream"], data["model_config"] = str(upstream), {"num_layers": 2}
    path.write_text(json.dumps(data))
    torch.save(
        {"utt_id": "u1", "features": torch.randn(30, 8), "speaker": 0},
        path.parent / "example_utterance.pt",
    )
    report = make_report(root)
    assert (root / "fig_attention_maps.png").is_file(), report.notes
    assert "fig_attention_maps.png" in (root / "README.md").read_text()


def test_bench_json_of_speechattn_bench_attention(tmp_path: Path, partial: Path) -> None:
    """The benchmark's own layout: per variant, measurements keyed by T (strings in JSON)."""
    lengths = [128, 256, 512, 1024]
    bench = {
        "meta": {"device": "cpu", "dim": 768, "heads": 12, "lengths": lengths},
        "variants": {
            "full": {
                "time_ms": {str(T): T / 10 for T in lengths},
                "peak_mem_mb": {str(T): T / 100 for T in lengths},
            },
            "ldsa": {
                "time_ms": {"128": 1.0},
                "peak_mem_mb": {},
                "errors": {"256": "out of memory"},
            },
        },
        "baselines": {"sdpa_mha": {"time_ms": {"128": 1.0}}},
    }
    path = tmp_path / "attention.json"
    path.write_text(json.dumps(bench))
    records, meta = read_bench(path)
    assert meta["device"] == "cpu"
    assert [(r.variant, r.seq_len, r.time_ms) for r in records][:2] == [
        ("full", 128, 12.8),
        ("full", 256, 25.6),
    ]
    assert ("ldsa", 128, 1.0, None) in [
        (r.variant, r.seq_len, r.time_ms, r.memory_mb) for r in records
    ]
    make_report(partial, out=tmp_path / "r", bench=path)
    md = (tmp_path / "r" / "table1.md").read_text()
    assert "time ms (T=128)" in md and "time ms (T=1024)" in md and "on cpu" in md
    assert sum(f"time ms (T={T})" in md for T in lengths) == 3  # the Markdown shows 3 lengths
    header = next(csv.reader(open(tmp_path / "r" / "table1.csv")))
    assert sum(h.startswith("time ms") for h in header) == 4  # the CSV keeps them all


def test_attention_maps_sit_under_the_utterances_spectrogram_in_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each column of maps has the utterance's log-mel above it (librosa's specshow), on the
    maps' time axis: 30 10-ms frames are 10 model frames, 0.3 s."""
    import librosa.display
    import torch

    from speechattn.data import Normalizer
    from speechattn.model.aalbert import aalbert
    from speechattn.model.upstream import save_upstream, upstream_state
    from speechattn.report.figures import attention_maps

    drawn = []
    specshow = librosa.display.specshow

    def spy(data, **kwargs):
        drawn.append((data.shape, kwargs))
        return specshow(data, **kwargs)

    monkeypatch.setattr(librosa.display, "specshow", spy)
    model = aalbert(feature_dim=8, dim=16, num_layers=2, num_heads=2, ffn_dim=32)
    state = upstream_state(model, Normalizer(torch.zeros(8), torch.ones(8)), {"n_mels": 8}, {})
    upstream = save_upstream(tmp_path / "upstream.pt", state)
    example = tmp_path / "example_utterance.pt"
    torch.save({"utt_id": "u1", "features": torch.randn(30, 8)}, example)
    assert attention_maps(upstream, example, tmp_path / "maps.png").is_file()
    assert len(drawn) == 2  # one spectrogram per column of heads
    shape, kwargs = drawn[0]
    assert shape == (8, 30) and (kwargs["sr"], kwargs["hop_length"]) == (16000, 160)
    assert kwargs["x_axis"] == "time" and kwargs["ax"].get_xlim() == pytest.approx((0.0, 0.3))


def test_rows_that_are_the_same_model_are_marked():
    """Under sign hashes xbox, xbox_qnf and simple_lsh are one model: the later rows say so.
    Under each scheme's own hash (the defaults) the five LSH rows are five models."""
    from speechattn.report.tables import _label, same_models

    names = ["full", "sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh"]
    sign = {n: {"hash": "sign"} for n in names[1:]}
    same = same_models(names, sign)
    assert same == {"xbox_qnf": "xbox", "simple_lsh": "xbox"}
    assert _label("simple_lsh", same) == "simple_lsh (same model as xbox)"
    assert same_models(names) == {}
