"""SUPERB through s3prl's own downstream runner, with speechattn upstreams (`docs/superb.md`).

Modules: `compat` (shims for what torch/torchaudio 2.11 removed from under s3prl 0.4.18),
`configs` (the task configs), `prepare` (the built-in corpus in each task's layout), `libriphone`
(the ctc corpus reader the s3prl wheel lacks), `run` (the command), `weights` (the Featurizer's
learned layer weights).
"""
