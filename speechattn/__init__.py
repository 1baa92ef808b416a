"""speechattn: study attention mechanisms in self-supervised speech transformers.

Layers (imports only go left to right):
    data -> attention / model -> tasks -> report
`bench` may use `data`, `attention` and `model`.
"""

from pathlib import Path

__version__ = "0.1.0"

# Hydra's configs: `conf/` inside the package after `pip install .` (setup.py maps it), else
# the repository's top-level one (a checkout or an editable install)
_HERE = Path(__file__).resolve().parent
CONFIG_DIR = _HERE / "conf" if (_HERE / "conf").is_dir() else _HERE.parent / "conf"


def load_upstream(path: str | Path, map_location: str = "cpu"):
    """Load a pretrained upstream: an `upstream.pt` of `python -m speechattn.pretrain` or an
    upstream folder (`python -m speechattn.export`); see `speechattn.model.upstream`."""
    from speechattn.model.upstream import load_upstream as _load

    return _load(path, map_location=map_location)


def code_version() -> str:
    """Package version plus the git commit of the checkout when there is one."""
    import subprocess

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{__version__}+{commit}" if commit else __version__
