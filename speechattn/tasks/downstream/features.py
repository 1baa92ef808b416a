"""Frozen upstream features for downstream probes and ABX: the `mel` upstream, loading,
normalisation, extraction and the cache (design: docs/downstream.md).

Shape letters: B batch, T 10 ms frames, T' upstream frames (T' = ceil(T / downsample)),
F input features, N cached layers, D hidden dim, U utterances in a split.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechattn.data.cache import file_sha256
from speechattn.errors import ConfigError, MissingFileError, SpeechattnError
from speechattn.model.serialization import TorchFileError, load_torch_file
from speechattn.model.upstream import UpstreamOutput, upstream_sha256
from speechattn.tasks.records import MEL  # the no-pretraining baseline's name
from speechattn.utils import atomic_path, atomic_write_bytes, digest, lengths_to_padding_mask, track

log = logging.getLogger(__name__)
CACHE_VERSION = 1
SPLITS = ("train", "dev", "test")


class MelUpstream(nn.Module):
    """The normalised input features as an upstream: one hidden state, no downsampling."""

    downsample = 1
    frame_rate = 100.0
    num_layers = 0
    num_heads = 0
    attention_name = MEL

    def __init__(self, feature_dim: int) -> None:
        super().__init__()
        self.hidden_dim = feature_dim
        self.metadata: dict[str, Any] = {}

    def forward(
        self,
        features: Tensor,
        lengths: Tensor,
        head_mask: Tensor | None = None,
        *,
        output_attentions: bool = False,
    ) -> UpstreamOutput:
        """features (B, T, F), lengths (B,) -> `UpstreamOutput`: the features with padding
        zeroed as its one hidden state, output_lengths = lengths, no attentions."""
        valid = ~lengths_to_padding_mask(lengths, features.size(1))  # (B, T)
        masked = features * valid.unsqueeze(-1).to(features.dtype)  # (B, T, F)
        return UpstreamOutput(
            last_hidden_state=masked,
            extract_features=masked,
            hidden_states=(masked,),
            attentions=() if output_attentions else None,
            output_lengths=lengths.clone(),
        )

    def output_lengths(self, lengths: Tensor) -> Tensor:
        return lengths.clone()


def open_upstream(
    spec: str | Path, feature_dim: int | None = None, data: Any = None
) -> tuple[nn.Module, str | None]:
    """The upstream `spec` names (`upstream.pt`, an upstream folder, or `mel`), frozen, and its
    file's sha256 (None for `mel`); raises naming the file when it is missing, unreadable or
    expects other features than `feature_dim` (`data`: names the data.* settings to change)."""
    if str(spec) == MEL:
        return MelUpstream(feature_dim).eval(), None
    path = Path(spec).expanduser()
    if not path.exists():  # a folder is refused by the loader, which names what it holds
        raise MissingFileError(
            f"upstream file {path} does not exist; pass upstream=PATH to an upstream.pt written "
            f"by `python -m speechattn.pretrain` (or its upstream folder), or upstream=mel"
        )
    from speechattn import load_upstream

    upstream = load_upstream(path).eval()  # its errors name the file and the problem
    dims = [getattr(upstream, name, None) for name in ("feature_dim", "input_dim")]
    expected = next((d for d in dims if isinstance(d, int)), None)
    if expected is not None and feature_dim is not None and expected != feature_dim:
        raise ConfigError(
            f"{path} expects {expected}-dim input features but the corpus provides "
            f"{feature_dim}{_feature_settings_differ(upstream, data)}"
        )
    upstream.requires_grad_(False)
    return upstream, upstream_sha256(path)


def _feature_settings_differ(upstream: nn.Module, data: Any) -> str:
    recorded = getattr(upstream, "feature_config", None)
    if data is None or not isinstance(recorded, dict):
        return "; use the same data.* feature settings as for pretraining"
    from speechattn.data.features import FeatureConfig

    pretrained = FeatureConfig(**recorded)
    fixes = [
        f"data.{name}={str(want).lower()} (given {str(getattr(data, name)).lower()})"
        for name in ("n_mels", "deltas")
        if getattr(data, name) != (want := getattr(pretrained, name))
    ]
    return f": it was pretrained on other features; set {', '.join(fixes) or 'the same data.*'}"


# `normalization=`: whose normalisation the features get before the upstream sees them
NORMALIZATION_CHOICES = ("upstream", "corpus")


@dataclass
class FeatureNormalization:
    """How the corpus's normalised features are adapted before the upstream sees them."""

    transform: Any  # f(features (B, T, F), padding_mask (B, T)) -> (B, T, F), or None
    record: dict[str, Any]  # result.json's: used, corpus, upstream (modes), differ
    cache_tag: str = ""  # appended to the feature cache key ("" where older caches stay valid)


def check_normalization(corpus_mode: str, upstream: nn.Module, choice: str) -> None:
    """Fail before any extraction when `normalization=choice` cannot be honoured."""
    if choice not in NORMALIZATION_CHOICES:
        raise ConfigError(
            f"normalization={choice!r}: choose upstream (the upstream's own normalisation, the "
            f"default) or corpus (data.normalization as given, mismatch recorded)"
        )
    own = getattr(upstream, "normalizer", None)  # None for mel
    utterance_only = corpus_mode == "utterance" and own is not None and own.mode != "utterance"
    if choice == "upstream" and utterance_only:
        raise ConfigError(
            f"data.normalization=utterance cannot be mapped onto the {own.mode} normalisation "
            f"{getattr(upstream, 'source', 'the upstream')} was pretrained with (per-utterance "
            f"statistics are not invertible): leave data.normalization={own.mode}, or set "
            f"normalization=corpus to probe per-utterance features anyway (recorded in "
            f"result.json)"
        )


def feature_normalization(
    normalizer: Any, upstream: nn.Module, choice: str = "upstream"
) -> FeatureNormalization:
    """The features as the upstream was pretrained (`choice="upstream"`: its own statistics
    and mode) or as the corpus's `normalizer` gives them (`"corpus"`: a mismatch is recorded)."""
    corpus_mode = getattr(normalizer, "mode", None)
    check_normalization(corpus_mode or "none", upstream, choice)
    own = getattr(upstream, "normalizer", None)
    record = {"used": choice, "corpus": corpus_mode, "upstream": getattr(own, "mode", None)}
    if own is None or normalizer is None:  # mel: the corpus's normalisation defines it
        log.info("features: normalised as data.normalization=%s (no pretraining)", corpus_mode)
        return FeatureNormalization(None, {**record, "used": "corpus", "differ": False})
    same = corpus_mode == own.mode and (
        own.mode != "global"
        or (
            torch.allclose(normalizer.mean, own.mean.cpu(), atol=1e-4)
            and torch.allclose(normalizer.std, own.std.cpu(), atol=1e-4)
        )
    )
    record["differ"] = not same
    pretrained = f"{own.mode} normalisation" + (
        " with its pretraining statistics" if own.mode == "global" else ""
    )
    if same:
        log.info("features: normalised as the upstream was pretrained (%s)", pretrained)
        return FeatureNormalization(None, record)
    # before `normalization=` existed, global/global with other statistics was remapped and
    # any other mismatch was left as it was: those cache keys stay, the new cases get a tag
    remapped_before = corpus_mode == own.mode == "global"
    if choice == "corpus":
        log.warning(
            "features: normalised as data.normalization=%s (normalization=corpus), not as the "
            "upstream was pretrained (%s); the mismatch is recorded in result.json",
            corpus_mode,
            pretrained,
        )
        return FeatureNormalization(None, record, "|norm=corpus" if remapped_before else "")
    log.info(
        "features: data.normalization=%s mapped onto the upstream's own %s (set "
        "normalization=corpus to keep the corpus's)",
        corpus_mode,
        pretrained,
    )
    src_mean, src_std = normalizer.mean, normalizer.std

    def remap(features: Tensor, padding_mask: Tensor) -> Tensor:
        raw = features  # (B, T, F) log-mel, as the corpus gives it without normalisation
        if corpus_mode == "global":
            raw = features * src_std.to(features.device) + src_mean.to(features.device)
        out = own(raw, (~padding_mask).sum(1))
        return out.masked_fill(padding_mask.unsqueeze(-1), 0.0)

    tag = "" if remapped_before else f"|norm=upstream:{own.mode}"
    return FeatureNormalization(remap, record, tag)


def resolve_layers(layer: str | int, num_layers: int) -> list[int]:
    """Indices of the hidden states to cache: `last` -> [L]; an integer i -> [i] (0 = input
    embedding, negative counts from the end); `weighted` -> [0, ..., L] (the probe mixes)."""
    count = num_layers + 1
    if layer in ("last", "weighted"):
        return [num_layers] if layer == "last" else list(range(count))
    try:
        index = int(layer)
    except (TypeError, ValueError):
        raise ConfigError(
            f"unknown layer choice {layer!r}; use last, weighted or an index in "
            f"[{-count}, {count - 1}]"
        ) from None
    if not -count <= index < count:
        raise ConfigError(
            f"layer={index} is out of range: the upstream has {count} hidden states "
            f"(0 = input embedding, {num_layers} = last layer)"
        )
    return [index % count]


@dataclass
class SplitFeatures:
    """Cached hidden states and labels of one split, utterances concatenated along time."""

    utt_ids: list[str]
    features: Tensor  # (ΣT', N, D) float16
    lengths: Tensor  # (U,) upstream frames per utterance
    input_lengths: Tensor  # (U,) 10 ms frames
    speakers: Tensor | None = None  # (U,)
    phones: Tensor | None = None  # (ΣT_lab,)
    phone_lengths: Tensor | None = None  # (U,)

    def __post_init__(self) -> None:
        U = len(self.utt_ids)
        counts = [
            len(t) for t in (self.lengths, self.input_lengths, self.speakers) if t is not None
        ]
        if any(n != U for n in counts):
            raise ValueError(f"{U} utterance ids but per-utterance fields of sizes {counts}")
        if int(self.lengths.sum()) != len(self.features):
            raise ValueError(
                f"lengths sum to {int(self.lengths.sum())} frames, features have {len(self.features)}"
            )
        if (self.phones is None) != (self.phone_lengths is None) or (
            self.phones is not None and int(self.phone_lengths.sum()) != len(self.phones)
        ):
            raise ValueError("phones and phone_lengths disagree")
        self._offsets = _offsets(self.lengths)
        self._phone_offsets = None if self.phone_lengths is None else _offsets(self.phone_lengths)

    def __len__(self) -> int:
        return len(self.utt_ids)

    def hidden(self, i: int) -> Tensor:
        """Utterance i's hidden states, (N, T'_i, D) float32."""
        return self.features[self._offsets[i] : self._offsets[i + 1]].transpose(0, 1).float()

    def phones_of(self, i: int) -> Tensor:
        """Utterance i's 10 ms phone ids, (T_lab_i,)."""
        if self._phone_offsets is None:
            raise ValueError("this split has no phone labels")
        return self.phones[self._phone_offsets[i] : self._phone_offsets[i + 1]]

    def state(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _offsets(lengths: Tensor) -> list[int]:
    return [0, *torch.cumsum(lengths.long(), 0).tolist()]


class NonFiniteFeaturesError(SpeechattnError, ValueError):
    """The upstream's hidden states hold NaN/inf: refused rather than probed at chance."""


class ImplausibleFeaturesError(NonFiniteFeaturesError):
    """Finite hidden states beyond FEATURE_LIMIT: a run that blew up without reaching inf."""


# Largest |hidden state| accepted: a trained AALBERT's (layer-normed) hidden states and the
# normalised log-mel stay within about 10-20; float16, the cache's dtype, overflows at 65504.
FEATURE_LIMIT = 1e4


def _check_features(
    cached: Tensor,
    computed: Tensor,
    upstream: nn.Module,
    layers: Sequence[int],
    utt_ids: Sequence[str],
    description: str,
) -> None:
    """Refuse hidden states not finite as `computed` (float32) or `cached` (float16), or beyond
    FEATURE_LIMIT. Padding is 0, so only real frames can fail."""
    source = getattr(upstream, "source", None) or upstream
    where = f"{description}: upstream {source} gives"
    whom = f"(layers {list(layers)}) for {', '.join(utt_ids[:3])}"
    retrain = "a probe on them would score chance. Pretrain again with a smaller model.optimizer.lr"
    if not bool(torch.isfinite(computed).all()):
        raise NonFiniteFeaturesError(
            f"{where} NaN/inf hidden states {whom}: its pretraining diverged (or the input "
            f"features hold NaN/inf); {retrain}"
        )
    peak = float(computed.abs().amax()) if computed.numel() else 0.0
    if not bool(torch.isfinite(cached).all()) or peak > FEATURE_LIMIT:
        raise ImplausibleFeaturesError(
            f"{where} hidden states up to |h| = {peak:.3g} {whom}, beyond {FEATURE_LIMIT:g} "
            f"(float16, the feature cache's type, overflows at 65504): its pretraining blew "
            f"up; {retrain}"
        )


@torch.no_grad()
def extract_split(
    upstream: nn.Module,
    batches: Iterable[dict[str, Any]],
    layers: Sequence[int],
    total: int | None = None,
    description: str = "features",
    device: torch.device | str = "cpu",
    transform: Any = None,
    progress_bar: bool = True,
) -> SplitFeatures:
    """Run the frozen upstream over `batches` (data-layer batch dicts) and keep `layers`;
    `transform(features, padding_mask) -> features` may adapt the normalisation first.
    `total`: batches, for the progress bar."""
    utt_ids: list[str] = []
    feats: list[Tensor] = []
    lengths: list[Tensor] = []
    input_lengths: list[Tensor] = []
    speakers: list[Tensor | None] = []  # None: a batch without (then the split has none)
    phones: list[Tensor] = []
    phone_lengths: list[Tensor | None] = []
    for batch in track(batches, description, total, progress_bar):
        x = batch["features"].to(device)  # (B, T, F)
        if transform is not None:
            x = transform(x, batch["padding_mask"].to(device))
        out = upstream(x, batch["lengths"].to(device))
        stacked = torch.stack([out.hidden_states[i] for i in layers], dim=2).cpu()  # (B, T', N, D)
        cached = stacked.to(torch.float16)
        _check_features(cached, stacked, upstream, layers, batch["utt_ids"], description)
        out_len = out.output_lengths.cpu()
        utt_ids += batch["utt_ids"]
        feats += [cached[b, :n] for b, n in enumerate(out_len)]
        lengths.append(out_len)
        input_lengths.append(batch["lengths"].cpu())
        speakers.append(batch.get("speaker"))
        pl = None if batch.get("phones") is None else batch["phone_lengths"].cpu()
        phone_lengths.append(pl)
        if pl is not None:
            phones += [batch["phones"][b, :n].cpu() for b, n in enumerate(pl)]
    if not utt_ids:
        raise ConfigError(f"{description}: the split is empty")
    if len(set(utt_ids)) != len(utt_ids):
        raise ValueError(f"{description}: duplicate utterance ids in the split")
    has_phones = all(pl is not None for pl in phone_lengths)
    return SplitFeatures(
        utt_ids=utt_ids,
        features=torch.cat(feats),
        lengths=torch.cat(lengths).long(),
        input_lengths=torch.cat(input_lengths).long(),
        speakers=None if any(s is None for s in speakers) else torch.cat(speakers).cpu().long(),
        phones=torch.cat(phones).long() if has_phones and phones else None,
        phone_lengths=torch.cat(phone_lengths).long() if has_phones else None,
    )


def split_loader(datamodule: Any, split: str) -> Any:
    """The deterministic loader of `split` (train | dev | test), for extraction."""
    if hasattr(datamodule, "extraction_dataloader"):
        return datamodule.extraction_dataloader(split)
    loaders = {"train": "train_dataloader", "dev": "val_dataloader", "test": "test_dataloader"}
    return getattr(datamodule, loaders[split])()


def extract(
    upstream: nn.Module,
    datamodule: Any,
    split: str,
    layers: Sequence[int],
    normalization: FeatureNormalization,
    device: torch.device | str,
    progress_bar: bool,
) -> SplitFeatures:
    """`extract_split` of one split of `datamodule` (what the probes and ABX both read)."""
    return extract_split(
        upstream.to(device),
        split_loader(datamodule, split),
        layers,
        description=f"features {split}",
        device=device,
        transform=normalization.transform,
        progress_bar=progress_bar,
    )


def cached_features(
    upstream: nn.Module,
    upstream_id: str,
    layers: list[int],
    datamodule: Any,
    data_config: dict[str, Any],
    cache_dir: str | Path,
    device: torch.device | str,
    progress_bar: bool,
    normalization: FeatureNormalization,
) -> dict[str, SplitFeatures]:
    """Hidden states `layers` of every split, from the cache or extracted (then cached) once."""
    normalizer = getattr(datamodule, "normalizer", None)
    h = hashlib.sha256()
    for t in (getattr(normalizer, "mean", None), getattr(normalizer, "std", None)):
        if t is not None:
            h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
    stats = h.hexdigest()[:16] + normalization.cache_tag
    key = {"version": CACHE_VERSION, "upstream": upstream_id, "layers": list(layers)}
    folder = Path(cache_dir).expanduser() / digest(
        {**key, "data": data_config, "stats": stats}, length=20
    )
    splits: dict[str, SplitFeatures] = {}
    for name in SPLITS:
        path = folder / f"{name}.pt"
        if path.is_file():
            try:
                splits[name] = load_split(path)
                log.info("features %s: cached %s", name, path)
                continue
            except DamagedSplit as e:
                log.warning("%s; extracting it again", e)
        splits[name] = extract(
            upstream, datamodule, name, layers, normalization, device, progress_bar
        )
        save_split(splits[name], path)
        log.info("features %s: %d utterances -> %s", name, len(splits[name]), path)
    return splits


class DamagedSplit(SpeechattnError, ValueError):
    """A cached split that does not match its checksum record or whose fields disagree."""


def save_split(split: SplitFeatures, path: Path) -> None:
    """Write the split, then its record (size and sha256), which commits it, each atomically."""
    with atomic_path(path) as tmp:
        torch.save(split.state(), tmp)
    record = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    atomic_write_bytes(path.with_name(path.name + ".sha256"), json.dumps(record).encode())


def load_split(path: Path) -> SplitFeatures:
    """The split at `path`, checked against its record; else `DamagedSplit` naming the file."""
    record_path = path.with_name(path.name + ".sha256")
    if not record_path.is_file():
        raise DamagedSplit(f"cached features {path}: no checksum record {record_path.name}")
    try:
        record = json.loads(record_path.read_text())
        size, sha256 = int(record["size"]), str(record["sha256"])
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedSplit(f"cached features {path}: unreadable record {record_path}: {e}") from e
    if path.stat().st_size != size or file_sha256(path) != sha256:
        raise DamagedSplit(f"cached features {path}: the file does not match its sha256 record")
    try:
        return SplitFeatures(**load_torch_file(path, "cpu", "cached downstream features"))
    except TorchFileError as e:  # matches its record, yet this torch cannot read it
        raise DamagedSplit(str(e)) from e
    except (TypeError, ValueError) as e:
        raise DamagedSplit(f"cached features {path}: {e}") from e
