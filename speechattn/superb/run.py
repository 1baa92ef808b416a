"""`python -m speechattn.superb [--quick] [--data DIR] RUN_DOWNSTREAM_ARGS...`: s3prl 0.4.18's
unmodified `run_downstream.py` in this process, with the `compat` shims, speechattn upstreams in
its hub and the defaults docs/superb.md lists; an evaluation also writes
EXPDIR/superb_result.json (`tasks.records.SuperbResult`) for `python -m speechattn.report`.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

import speechattn
from speechattn.data.synth import ensure_embedded_corpus
from speechattn.errors import ConfigError, SpeechattnError
from speechattn.model.serialization import load_torch_file
from speechattn.model.upstream import UPSTREAM_FOLDER, upstream_sha256
from speechattn.superb import compat, prepare
from speechattn.superb.configs import METRIC, task_config
from speechattn.tasks.records import WEIGHTED_SUM, SuperbResult
from speechattn.utils import atomic_write_text

log = logging.getLogger(__name__)

# the resolved task config a training run reads (its name records whether it is --quick)
CONFIG_FILE, QUICK_CONFIG_FILE = "superb_config.yaml", "superb_config_quick.yaml"
UPSTREAM_NAMES = ("speechattn", "speechattn_local")


def _inspect(argv: list[str]) -> argparse.Namespace:
    """The run_downstream.py options this wrapper reads (the parser's own, unchanged)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-m", "--mode")
    parser.add_argument("-t", "--evaluate_split", default="test")
    parser.add_argument("-e", "--past_exp")
    parser.add_argument("-c", "--config")
    parser.add_argument("-d", "--downstream")
    parser.add_argument("-u", "--upstream")
    parser.add_argument("-k", "--upstream_ckpt")
    parser.add_argument("-n", "--expname")
    parser.add_argument("-p", "--expdir")
    parser.add_argument("-s", "--upstream_feature_selection", default="hidden_states")
    parser.add_argument("-l", "--upstream_layer_selection", type=int)
    parser.add_argument("--device")
    parser.add_argument("--hub", default="torch")
    parser.add_argument("--push_to_hf_hub", default=False)
    return parser.parse_known_args(argv)[0]


RESULTS = Path("result") / "superb"  # default results folder (docs/superb.md; .gitignore'd)


def selection(args: argparse.Namespace) -> str:
    """The features the downstream reads, as results record it: "weighted sum" (s3prl's
    Featurizer over every layer) or "layer N" (`-l N`), with a non-default `-s` before it."""
    layer = getattr(args, "upstream_layer_selection", None)
    chosen = WEIGHTED_SUM if layer is None else f"layer {layer}"
    feature = getattr(args, "upstream_feature_selection", "hidden_states")
    return chosen if feature == "hidden_states" else f"{feature} {chosen}"


def default_expdir(
    task: str, upstream: str, ckpt: str | None, quick: bool, layer: int | None = None
) -> Path:
    """result/superb/<task>[-quick]/<upstream>[-<run>][-layer<N>]: the run is the folder
    holding the upstream.pt or the run's upstream folder, else the upstream folder itself."""
    name = upstream
    if ckpt:
        path = Path(ckpt).resolve()
        in_run = path.is_file() or path.name == UPSTREAM_FOLDER
        name += f"-{(path.parent if in_run else path).name}"
    name += f"-layer{layer}" if layer is not None else ""
    return RESULTS / (task + ("-quick" if quick else "")) / name


def latest_checkpoint(expdir: Path) -> Path:
    """The checkpoint `-m evaluate` uses: dev-best.ckpt, else the latest states-*.ckpt."""
    best = expdir / "dev-best.ckpt"
    if best.is_file():
        return best
    states = sorted(expdir.glob("states-*.ckpt"), key=lambda p: int(p.stem.split("-")[-1]))
    if not states:
        raise ConfigError(
            f"-m evaluate: no dev-best.ckpt or states-*.ckpt in {expdir}; train first (same "
            f"arguments with -m train) or pass the checkpoint with -e"
        )
    return states[-1]


def _data_paths(task: str, data: str | Path | None) -> dict[str, Any]:
    """`task`'s data paths in the prepared folder `data` (default: the built-in corpus')."""
    if data is None:
        root = ensure_embedded_corpus()
        data = prepare.prepare(task, root, prepare.default_out(root, task))
    return prepare.data_config(data, task)


def build_argv(argv: list[str], quick: bool, data: str | None) -> tuple[list[str], dict[str, Any]]:
    """The run_downstream.py command line for `argv`, and what the wrapper decided (expdir,
    task, ...). Writes the task config into the experiment folder for a new training run."""
    args = _inspect(argv)
    if args.hub != "torch" or args.push_to_hf_hub not in (False, "False", "false"):
        raise ConfigError(
            "--hub huggingface / --push_to_hf_hub: speechattn.superb runs local upstreams only "
            "(the Hugging Face Hub calls need huggingface_hub < 1.0)"
        )
    if args.mode is None:
        raise ConfigError("-m/--mode is required: train, evaluate or inference")
    if args.past_exp and Path(args.past_exp).is_file():
        runner_checkpoint(Path(args.past_exp))
    if args.upstream in UPSTREAM_NAMES and not args.past_exp:
        if not args.upstream_ckpt:
            raise ConfigError(
                f"-u {args.upstream} needs -k RUN/upstream.pt (or an upstream folder)"
            )
        if not Path(args.upstream_ckpt).exists():
            raise ConfigError(
                f"-k {args.upstream_ckpt}: no such file or folder; give the upstream.pt of a "
                f"python -m speechattn.pretrain run, or an upstream folder (RUN/upstream)"
            )
    out = list(argv)
    if args.device is None:
        out += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    expdir = Path(args.expdir) if args.expdir else None
    if expdir is None and args.expname:
        expdir = Path("result") / "downstream" / args.expname  # run_downstream.py's own rule
    if expdir is None and not args.past_exp:
        if not (args.downstream and args.upstream):
            raise ConfigError("-d TASK and -u UPSTREAM are needed (or -e CHECKPOINT, -p EXPDIR)")
        expdir = default_expdir(
            args.downstream, args.upstream, args.upstream_ckpt, quick, args.upstream_layer_selection
        )
        out += ["-p", str(expdir)]
    if args.mode == "evaluate" and not args.past_exp:
        out += ["-e", str(latest_checkpoint(expdir))]
    elif args.mode == "train" and not args.past_exp and not args.config:
        task_config(args.downstream or "")  # an unknown task fails before data is prepared
        config = task_config(args.downstream, quick, _data_paths(args.downstream, data))
        expdir.mkdir(parents=True, exist_ok=True)
        path = expdir / (QUICK_CONFIG_FILE if quick else CONFIG_FILE)
        atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
        out += ["-c", str(path)]
    elif quick or data:
        log.warning(
            "--quick/--data apply to a new training run; this run reads its checkpoint's config"
        )
    if expdir is None:  # -e CHECKPOINT: its experiment folder
        past = Path(args.past_exp)
        expdir = past.parent if past.is_file() else past
    return out, {"expdir": expdir, "args": args, "quick": quick}


def runner_checkpoint(path: Path, what: str = "-e checkpoint") -> dict[str, Any]:
    """The state in a runner checkpoint, read weights-only with its `Args` allowed; a file that
    loading refuses or the runner did not write (no `Args`) is refused in one line naming it."""
    compat.install_checkpoints()  # the runner's Args (argparse.Namespace) is allowed
    try:
        state = load_torch_file(path, what=what)
    except SpeechattnError as err:
        raise ConfigError(
            f"{err} (a checkpoint of s3prl's runner, states-*.ckpt, is needed)"
        ) from err
    if not isinstance(state, dict) or "Args" not in state:
        raise ConfigError(
            f"{what} {path}: not a checkpoint of s3prl's runner (no Args in it); give "
            "EXPDIR/states-*.ckpt or dev-best.ckpt of a training run"
        )
    return state


def run_downstream(argv: list[str], expdir: Path | None = None) -> None:
    """s3prl's run_downstream.main() on `argv` (shims installed first; `expdir` holds the
    per-experiment caches); `-u speechattn` / `-u speechattn_local` resolve in its hub."""
    compat.install()  # before s3prl imports what the shims bridge
    from s3prl import hub

    from speechattn.interop.s3prl import speechattn_local

    for name in UPSTREAM_NAMES:
        setattr(hub, name, speechattn_local)
    if expdir is not None:
        compat.set_voxceleb1_cache(expdir)
    from s3prl import run_downstream as script

    saved = sys.argv
    sys.argv = ["run_downstream.py", *argv]
    try:
        script.main()
    finally:
        sys.argv = saved


def score(task: str, expdir: Path, split: str) -> float:
    """The metric of `split` from the prediction files s3prl's evaluation wrote in `expdir`."""
    if task == "ctc":
        from s3prl.downstream.ctc.metric import per

        hyp, ref = _ark(expdir / f"{split}-hyp.ark"), _ark(expdir / f"{split}-ref.ark")
        return float(per([hyp[k] for k in ref], [ref[k] for k in ref]))
    predicted, truth = _ark(expdir / f"{split}_predict.txt"), _ark(expdir / f"{split}_truth.txt")
    if not truth:
        raise ConfigError(f"{expdir}/{split}_truth.txt is empty: the {split} split has no data")
    return sum(predicted.get(k) == v for k, v in truth.items()) / len(truth)


def _ark(path: Path) -> dict[str, str]:
    """Lines "<id> <text>" -> {id: text}."""
    if not path.is_file():
        raise ConfigError(f"{path}: s3prl wrote no predictions (did the evaluation run?)")
    lines = (line.rstrip("\n").split(" ", 1) for line in path.read_text().splitlines() if line)
    return {parts[0]: parts[1] if len(parts) > 1 else "" for parts in lines}


def write_result(decided: dict[str, Any]) -> SuperbResult:
    """Score the finished evaluation and write EXPDIR/superb_result.json."""
    args = decided["args"]
    checkpoint = Path(args.past_exp) if args.past_exp else latest_checkpoint(decided["expdir"])
    state = runner_checkpoint(checkpoint)
    ckpt_args = state["Args"]
    expdir, task = Path(ckpt_args.expdir), ckpt_args.downstream
    metric, higher = METRIC.get(task, ("accuracy", True))
    value = score(task, expdir, args.evaluate_split)
    attention = ckpt_args.upstream
    if ckpt_args.upstream in UPSTREAM_NAMES:
        attention = speechattn.load_upstream(ckpt_args.upstream_ckpt).attention_name
    sha = upstream_sha256(ckpt_args.upstream_ckpt) if ckpt_args.upstream_ckpt else None
    result = SuperbResult(
        task=task,
        metric=metric,
        value=value,
        higher_is_better=higher,
        split=args.evaluate_split,
        upstream=ckpt_args.upstream,
        upstream_ckpt=ckpt_args.upstream_ckpt,
        attention=attention,
        quick=os.path.basename(str(ckpt_args.config)) == QUICK_CONFIG_FILE,
        steps=int(state.get("Step", 0)),
        checkpoint=str(checkpoint),
        code_version=speechattn.code_version(),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        selection=selection(ckpt_args),
        upstream_sha256=sha,
        expdir=str(expdir),
    )
    result.write(expdir)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechattn.superb",
        description="s3prl's run_downstream.py with speechattn upstreams (docs/superb.md); "
        "every other argument goes to run_downstream.py unchanged",
        add_help=False,
    )
    parser.add_argument("--quick", action="store_true", help="the quick config (minutes on CPU)")
    parser.add_argument("--data", help="prepared task folder (default: built-in corpus)")
    parser.add_argument("--superb-help", action="help", help="this help")
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in rest):
        print(parser.format_help())
        print("run_downstream.py's own arguments:\n")
        run_downstream(["-h"])
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv_out, decided = build_argv(rest, ours.quick, ours.data)
    log.info("run_downstream.py %s", " ".join(argv_out))
    run_downstream(argv_out, decided["expdir"])
    if decided["args"].mode == "evaluate":
        result = write_result(decided)
        print(f"{result.task} {result.split} {result.metric}: {result.value:.4f}")
