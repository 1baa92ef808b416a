"""`python -m speechattn.bench {features,attention,pretrain,pruning,loader,scale} [options]`.

Each benchmark lives in its own module and measures the compared variants side by side in
one run, printing ratios rather than absolute targets (machines are noisy). `loader` times
the pretraining train loader against a GPU's need; `scale` measures start-up and the loader
over generated corpora of growing size, which `corpus` writes (LibriSpeech layout).
"""

import importlib
import sys

BENCHMARKS = {
    "features": "speechattn.bench.features",
    "attention": "speechattn.bench.attention",
    "pretrain": "speechattn.bench.pretrain",
    "pruning": "speechattn.bench.pruning",
    "loader": "speechattn.bench.loader",
    "scale": "speechattn.bench.scale",
    "corpus": "speechattn.bench.corpus",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)
        print("benchmarks:", ", ".join(BENCHMARKS))
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name])
    module.main(rest)


if __name__ == "__main__":
    main()
