"""Our upstreams in other toolkits: s3prl's upstream interface (`interop.s3prl`).

torch.hub entry points are in the repository's `hubconf.py`. This layer reads `upstream.pt`
through `speechattn.model.load_upstream` only; no layer imports it, only `superb` (s3prl's
SUPERB runner with our upstreams), which sits beside it.
"""
