"""`python -m speechattn.bench [--debug] {features,attention,pretrain,...,lsh_recall} [options]`.

Each benchmark lives in its own module and measures the compared variants side by side in
one run, printing ratios rather than absolute targets (machines are noisy). `loader` times
the pretraining train loader against a GPU's need; `scale` measures start-up and the loader
over generated corpora of growing size, which `corpus` writes (LibriSpeech layout).
A SpeechattnError (bad settings, a damaged file) ends the run with one line and exit status 1;
`--debug` (or HYDRA_FULL_ERROR=1) shows its traceback; a usage error exits with status 2.
"""

import importlib
import sys

from speechattn.errors import command_line_errors

# each is the module speechattn.bench.<name>
BENCHMARKS = (
    "features",
    "attention",
    "pretrain",
    "pruning",
    "loader",
    "scale",
    "corpus",
    "lease",
    "lsh_recall",
)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(argv) and argv[0] == "--debug"
    argv = argv[1:] if debug else argv
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__, file=sys.stdout if argv else sys.stderr)
        print("benchmarks:", ", ".join(BENCHMARKS), file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(
            f"python -m speechattn.bench: error: unknown benchmark {name!r}; choose one of: "
            f"{', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    module = importlib.import_module(f"speechattn.bench.{name}")
    with command_line_errors(debug, f"python -m speechattn.bench {name}"):
        module.main(rest)


if __name__ == "__main__":
    main()
