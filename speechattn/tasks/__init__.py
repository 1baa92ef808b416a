"""LightningModules and their helpers (Lightning owns the loops; no runner classes).

- `pretrain`: AALBERT masked reconstruction (`PretrainTask`), resumable data order,
  non-finite step handling, `upstream.pt` export; `pretrain_data`: the resumable data view;
  `common`: callbacks shared by entry points (`MetricsCSV`, progress bars).
- `downstream` and friends: frozen-upstream probes (SPEC 7).

Modules are imported explicitly (`from speechattn.tasks.pretrain import PretrainTask`), so
importing this package stays cheap.
"""
