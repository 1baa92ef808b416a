"""Frozen upstream features for downstream probes: the `mel` upstream, loading, extraction, cache.

An upstream is anything with the contract of `speechattn.load_upstream` (docs/ARCHITECTURE.md):
`forward(features (B, T, F), lengths (B,)) -> list[(B, T', D)]`, `output_lengths`, `downsample`,
`hidden_dim`, `num_layers`, `attention_name`, `metadata`. `MelUpstream` wraps the normalised input
features in that contract, so the no-pretraining baseline goes through the same code path.

Extraction runs the upstream once over train/dev/test and stores the chosen hidden layers per
split in `cache_dir/<key>/<split>.pt`, the key hashing the upstream file, the layers, the data
config and the normalisation statistics. Writes are atomic, so an interrupted run never leaves a
half-written split behind; finished splits are reused. Each split's file is followed by its
record `<split>.pt.sha256` (size and sha256, written last: the commit marker), and a split is
read only when the file matches its record and its fields agree with each other; otherwise
`load_split` raises `DamagedSplit` and the run extracts that split again.

Shape letters: B batch, T 10 ms frames, T' upstream frames (T' = ceil(T / downsample)),
F input features, N cached layers, D hidden dim, U utterances in a split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechattn.data.cache import file_sha256
from speechattn.errors import ConfigError, MissingFileError, SpeechattnError
from speechattn.model.serialization import TorchFileError, load_torch_file
from speechattn.model.upstream import UpstreamFileError
from speechattn.utils import atomic_path, atomic_write_bytes, digest, lengths_to_padding_mask
from speechattn.utils import progress_bar as progress

MEL = "mel"
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
        self, features: Tensor, lengths: Tensor, head_mask: Tensor | None = None
    ) -> list[Tensor]:
        """features (B, T, F), lengths (B,) -> [features (B, T, F)] with padding zeroed."""
        T = features.size(1)
        valid = ~lengths_to_padding_mask(lengths, T)  # (B, T)
        return [features * valid.unsqueeze(-1).to(features.dtype)]

    def output_lengths(self, lengths: Tensor) -> Tensor:
        return lengths.clone()


def open_upstream(spec: str | Path, feature_dim: int) -> tuple[nn.Module, str | None]:
    """Load the upstream named by `spec` (a path to `upstream.pt`, or `mel`), frozen, in eval mode.

    Returns the upstream and the sha256 of its file (None for `mel`). Raises `FileNotFoundError`
    or `ValueError` naming the file when it is missing, corrupt, not ours, or expects other
    input features than the corpus provides.
    """
    if str(spec) == MEL:
        return MelUpstream(feature_dim).eval(), None
    path = Path(spec).expanduser()
    if not path.exists():  # a folder is refused by the loader, which names what it holds
        raise MissingFileError(
            f"upstream file {path} does not exist; pass upstream=PATH to an upstream.pt written "
            f"by `python -m speechattn.pretrain`, or upstream=mel"
        )
    from speechattn import load_upstream

    try:
        upstream = load_upstream(path)
    except ValueError:  # the loader's own error already names the file and the problem
        raise
    except Exception as e:  # anything else unexpected still means "not a usable upstream"
        raise UpstreamFileError(
            f"{path} is not a valid speechattn upstream file (corrupt, truncated or not written "
            f"by `python -m speechattn.pretrain`): {type(e).__name__}: {e}"
        ) from e
    expected = _upstream_feature_dim(upstream)
    if expected is not None and expected != feature_dim:
        raise ConfigError(
            f"{path} expects {expected}-dim input features but the corpus provides "
            f"{feature_dim}; use the same data.* feature settings as for pretraining"
        )
    upstream.eval()
    for p in upstream.parameters():
        p.requires_grad_(False)
    return upstream, file_sha256(path)


def _upstream_feature_dim(upstream: nn.Module) -> int | None:
    for name in ("feature_dim", "input_dim"):
        value = getattr(upstream, name, None)
        if isinstance(value, int):
            return value
    return None


def resolve_layers(layer: str | int, num_layers: int) -> list[int]:
    """Indices of the hidden states to cache for a layer choice.

    `last` -> [L]; an integer i -> [i] (0 = input embedding, negative counts from the end);
    `weighted` -> [0, ..., L] (the probe learns the mix).
    """
    count = num_layers + 1  # hidden[0] is the input embedding
    if layer == "last":
        return [num_layers]
    if layer == "weighted":
        return list(range(count))
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
    """Cached hidden states and labels of one split, utterances concatenated along time.

    features (ΣT', N, D) float16; lengths (U,) upstream frames per utterance; input_lengths (U,)
    10 ms frames; speakers (U,) or None; phones (ΣT_lab,) or None with phone_lengths (U,).
    """

    utt_ids: list[str]
    features: Tensor
    lengths: Tensor
    input_lengths: Tensor
    speakers: Tensor | None = None
    phones: Tensor | None = None
    phone_lengths: Tensor | None = None

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
        a, b = self._offsets[i], self._offsets[i + 1]
        return self.features[a:b].transpose(0, 1).float()

    def phones_of(self, i: int) -> Tensor:
        """Utterance i's 10 ms phone ids, (T_lab_i,)."""
        if self.phones is None or self._phone_offsets is None:
            raise ValueError("this split has no phone labels")
        a, b = self._phone_offsets[i], self._phone_offsets[i + 1]
        return self.phones[a:b]

    def state(self) -> dict[str, Any]:
        return {
            "utt_ids": self.utt_ids,
            "features": self.features,
            "lengths": self.lengths,
            "input_lengths": self.input_lengths,
            "speakers": self.speakers,
            "phones": self.phones,
            "phone_lengths": self.phone_lengths,
        }


def _offsets(lengths: Tensor) -> list[int]:
    return [0, *torch.cumsum(lengths.long(), 0).tolist()]


def cache_key(upstream_id: str, layers: Sequence[int], data: dict[str, Any], stats: str) -> str:
    """Hash of everything the cached features depend on."""
    return digest(
        {
            "version": CACHE_VERSION,
            "upstream": upstream_id,
            "layers": list(layers),
            "data": data,
            "stats": stats,
        },
        length=20,
    )


def tensor_digest(*tensors: Tensor | None) -> str:
    """Short digest of tensor values (normalisation statistics go into the cache key)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class NonFiniteFeaturesError(SpeechattnError, ValueError):
    """The upstream's hidden states hold NaN/inf: refused rather than probed at chance."""


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
    """Run the frozen upstream over `batches` (data-layer batch dicts) and keep `layers`.

    `transform(features, padding_mask) -> features` may adapt the corpus normalisation to the
    upstream's. Shows a progress bar.
    """
    utt_ids: list[str] = []
    feats: list[Tensor] = []
    lengths: list[Tensor] = []
    input_lengths: list[Tensor] = []
    speakers: list[Tensor] = []
    phones: list[Tensor] = []
    phone_lengths: list[Tensor] = []
    has_speaker = has_phones = True
    with progress(total, description, progress_bar) as advance:
        for batch in batches:
            x = batch["features"].to(device)  # (B, T, F)
            n = batch["lengths"].to(device)  # (B,)
            if transform is not None:
                x = transform(x, batch["padding_mask"].to(device))
            hidden = upstream(x, n)
            out_len = upstream.output_lengths(n).cpu()  # (B,)
            stacked = torch.stack([hidden[i] for i in layers], dim=2).cpu()  # (B, T', N, D)
            if not bool(torch.isfinite(stacked).all()):  # padding is 0, so only real frames
                raise NonFiniteFeaturesError(
                    f"{description}: upstream {getattr(upstream, 'source', None) or upstream} "
                    f"gives NaN/inf hidden states (layers {list(layers)}) for "
                    f"{', '.join(batch['utt_ids'][:3])}: its pretraining diverged (or the input "
                    f"features hold NaN/inf); a probe on them would score chance. Pretrain "
                    f"again with a smaller model.optimizer.lr"
                )
            for b, utt in enumerate(batch["utt_ids"]):
                utt_ids.append(utt)
                feats.append(stacked[b, : out_len[b]].to(torch.float16))
            lengths.append(out_len)
            input_lengths.append(batch["lengths"].cpu())
            if has_speaker and batch.get("speaker") is not None:
                speakers.append(batch["speaker"].cpu())
            else:
                has_speaker = False
            if has_phones and batch.get("phones") is not None:
                pl = batch["phone_lengths"].cpu()
                phone_lengths.append(pl)
                phones.extend(batch["phones"][b, : pl[b]].cpu() for b in range(len(pl)))
            else:
                has_phones = False
            advance(1)
    if not utt_ids:
        raise ConfigError(f"{description}: the split is empty")
    if len(set(utt_ids)) != len(utt_ids):
        raise ValueError(f"{description}: duplicate utterance ids in the split")
    width = len(layers)
    return SplitFeatures(
        utt_ids=utt_ids,
        features=torch.cat(feats) if feats else torch.zeros(0, width, 0, dtype=torch.float16),
        lengths=torch.cat(lengths).long(),
        input_lengths=torch.cat(input_lengths).long(),
        speakers=torch.cat(speakers).long() if has_speaker and speakers else None,
        phones=torch.cat(phones).long() if has_phones and phones else None,
        phone_lengths=torch.cat(phone_lengths).long() if has_phones and phone_lengths else None,
    )


class DamagedSplit(SpeechattnError, ValueError):
    """A cached split that does not match its checksum record or whose fields disagree."""


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save_split(split: SplitFeatures, path: Path) -> None:
    """Atomic writes (temp file in the same folder, then rename): the split, then its record
    (size and sha256), which commits it."""
    with atomic_path(path) as tmp:
        torch.save(split.state(), tmp)
    record = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    atomic_write_bytes(_record_path(path), json.dumps(record).encode())


def load_split(path: Path) -> SplitFeatures:
    """The split at `path` after checking it against its record; `DamagedSplit` (naming the
    file and what is wrong) when there is no record, the bytes differ or the fields disagree."""
    record_path = _record_path(path)
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
