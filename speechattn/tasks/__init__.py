"""The jobs, one package each, as LightningModules and plain functions (Lightning owns the
loops; there is no runner class):

- `pretrain/`: AALBERT masked reconstruction, resumable data order, upstream.pt + model card
- `downstream/`: frozen-upstream probes, cached features, result.json
- `analysis/`: head importance, ablation and pruning, heads.json
- `records`: the result.json / heads.json schemas the report reads
- `common`: Lightning callbacks and helpers the entry points share (metrics.csv, progress bars)

Import what you use (`from speechattn.tasks.pretrain import PretrainTask`); this package's
root imports nothing, so `speechattn.tasks.records` stays cheap for the report.
"""
