"""Our upstreams in other toolkits: s3prl's upstream interface (`interop.s3prl`); torch.hub
entry points are in the repository's `hubconf.py`. Only `superb` imports this layer.
"""
