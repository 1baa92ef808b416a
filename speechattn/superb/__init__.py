"""SUPERB through s3prl's own downstream runner, with speechattn upstreams (`docs/superb.md`).

    python -m speechattn.superb.prepare --task all              # built-in corpus -> task layouts
    python -m speechattn.superb -m train -u speechattn -k RUN/upstream.pt -d speech_commands --quick
    python -m speechattn.superb -m evaluate -u speechattn -k RUN/upstream.pt -d speech_commands --quick

Modules: `compat` (in-process shims for what torch/torchaudio 2.11 removed from under s3prl
0.4.18), `configs` (SUPERB task configs: paper hyper-parameters and `--quick`), `prepare` (the
built-in corpus in each task's layout), `libriphone` (the ctc corpus reader missing from the
s3prl wheel), `run` (the command), `weights` (the Featurizer's learned layer weights:
`python -m speechattn.superb.weights EXPDIR`).
"""
