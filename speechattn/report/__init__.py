"""Tables and figures of the attention study from a results folder (`python -m speechattn.report`).

Reads files only: `result.json` of downstream runs, the attention benchmark JSON, `heads.json` of
head analyses and, for attention maps, an `upstream.pt` with the utterance saved beside a result.
"""
