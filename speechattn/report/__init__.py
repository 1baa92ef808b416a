"""Tables and figures of the attention study from a results folder (`python -m speechattn.report`,
docs/report.md); it reads files only: results, benchmarks, head analyses and upstreams.
"""
