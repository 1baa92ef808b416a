"""torch.hub entry points for speechattn upstreams (any attention variant).

    up = torch.hub.load(REPO_DIR, "speechattn_upstream", source="local", ckpt="run/upstream.pt")
    hidden = up(features, lengths).hidden_states         # L+1 hidden states (B, T', D)
    expert = torch.hub.load(REPO_DIR, "speechattn_s3prl", source="local", ckpt=PATH)
    expert([wav])["hidden_states"]                       # s3prl's upstream interface

Both read `ckpt`, an `upstream.pt` or an upstream folder (config.json + model.safetensors,
`python -m speechattn.export`), through `speechattn.model.load_upstream`: a file with
`weights_only=True`, a folder without any pickle. Nothing is downloaded. REPO_DIR is a checkout of this repository with speechattn's dependencies
installed (`pip install -e .`).
"""

from __future__ import annotations

from speechattn.errors import ConfigError

# torch.hub checks that these import before calling an entry point
dependencies = ["torch", "torchaudio", "numpy"]


def speechattn_upstream(ckpt: str | None = None, map_location: str = "cpu"):
    """A pretrained speechattn upstream (`speechattn.model.Upstream`, eval mode) from `ckpt`,
    an `upstream.pt` written by `python -m speechattn.pretrain` or an upstream folder."""
    from speechattn.model.upstream import load_upstream

    return load_upstream(_required(ckpt), map_location=map_location)


def speechattn_s3prl(ckpt: str | None = None, map_location: str = "cpu"):
    """The same upstream behind s3prl's upstream interface (`speechattn.interop.s3prl`), in
    eval mode like `speechattn_upstream`."""
    from speechattn.interop.s3prl import UpstreamExpert

    return UpstreamExpert(_required(ckpt), map_location=map_location)


def _required(ckpt: str | None) -> str:
    if not ckpt:
        raise ConfigError(
            "speechattn hub entry points need ckpt=PATH of an upstream.pt or upstream folder, e.g. "
            'torch.hub.load(REPO_DIR, "speechattn_upstream", source="local", ckpt=PATH)'
        )
    return ckpt
