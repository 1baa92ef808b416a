"""Downstream job: probes on a frozen upstream (docs/downstream.md): `labels` (the label
sources), `features` (extraction and cache), `run` (the probe and `run(cfg)`)."""

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
