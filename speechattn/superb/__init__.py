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

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from speechattn.errors import SpeechattnError


def run_command(main: Callable[[], object]) -> None:
    """`main()` for a command line: a `SpeechattnError` ends it with one line and exit 1."""
    try:
        main()
    except SpeechattnError as e:
        logging.getLogger("speechattn.superb").error("%s", e)
        sys.exit(1)
