"""Downstream job: probes on a frozen upstream (docs/downstream.md).

- `labels`: the label sources (`target` of a task: speaker, phones, pitch, ...), one file each
- `features`: frozen-upstream features, extracted once per split and cached
- `run`: `TaskConfig`, the cached features as a dataset, `DownstreamProbe`, and `run(cfg)`,
  what `python -m speechattn.downstream` does
"""

from speechattn.tasks.downstream.labels.phones import check_label_lengths
from speechattn.tasks.downstream.run import (
    DownstreamProbe,
    ProbeDataset,
    TaskConfig,
    collate,
    fit_probe,
    labelled_data_config,
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
    "run",
]
