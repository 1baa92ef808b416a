"""The jobs, one package each (`pretrain/`, `downstream/`, `analysis/`, `abx/`), as
LightningModules and plain functions; `records`: the schemas the report reads; `common`: the
callbacks the entry points share. This root imports nothing, so `records` stays cheap.
"""
