"""Downstream job: probes on a frozen upstream (docs/downstream.md).

- `probe`: `TaskConfig`, the cached features as a dataset, `DownstreamProbe`
- `features`: frozen-upstream features, extracted once per split and cached
- `run`: `run(cfg)`, what `python -m speechattn.downstream` does
"""

from speechattn.tasks.downstream.probe import DownstreamProbe, ProbeDataset, TaskConfig, collate
from speechattn.tasks.downstream.run import (
    check_label_lengths,
    fit_probe,
    labelled_data_config,
    renormalizer,
    run,
)

__all__ = [
    "DownstreamProbe",
    "ProbeDataset",
    "TaskConfig",
    "check_label_lengths",
    "collate",
    "fit_probe",
    "labelled_data_config",
    "renormalizer",
    "run",
]
