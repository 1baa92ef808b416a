"""`python -m speechattn.superb.weights EXPDIR|CHECKPOINT [--json]`: the layer weights s3prl's
Featurizer learned in a SUPERB run (the weighted sum of the upstream's hidden states the
downstream read), as the softmax the Featurizer applies; layer 0 is the input embedding.

The runner's checkpoint is read weights-only (`run.runner_checkpoint`); a folder
means its `dev-best.ckpt`, else its latest `states-*.ckpt` (`run.latest_checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from speechattn.errors import ConfigError, command_line_errors


def layer_weights(path: Path) -> list[float]:
    """The Featurizer's softmax layer weights in the runner checkpoint (or folder) `path`."""
    from speechattn.superb.run import latest_checkpoint, runner_checkpoint

    checkpoint = latest_checkpoint(path) if path.is_dir() else path
    weights = runner_checkpoint(checkpoint, "SUPERB checkpoint").get("Featurizer", {})
    weights = weights.get("weights") if isinstance(weights, dict) else None
    if not isinstance(weights, torch.Tensor) or weights.dim() != 1:
        raise ConfigError(
            f"{checkpoint}: no Featurizer layer weights in it (a run with -l N reads one layer "
            "and learns none; a checkpoint of s3prl's runner is needed)"
        )
    return torch.softmax(weights.float(), 0).tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechattn.superb.weights", description=__doc__
    )
    parser.add_argument("path", type=Path, help="experiment folder or runner checkpoint")
    parser.add_argument("--json", action="store_true", help="print them as a JSON list")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    weights = layer_weights(args.path)
    if args.json:
        print(json.dumps(weights))
        return
    print("layer  weight")
    for layer, weight in enumerate(weights):
        print(f"{layer:>5}  {weight:.4f}  {'#' * round(40 * weight)}")


if __name__ == "__main__":
    with command_line_errors(prog="python -m speechattn.superb.weights"):
        main()
