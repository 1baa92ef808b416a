"""How well each LSH scheme searches the score it weighs with: the share of its k selected keys
that are among the k best keys by that score (recall at k), per scheme and hash.

Each scheme is built at the study's size (D = 768, h = 12, seeded weights) and selects on B
random inputs x ~ N(0, 1); the score is shared_qk's q_i . k_j (normalised keys unless
`--raw-keys`), the query's own key excluded from both sets (docs/attention.md, LSH).
"""

from __future__ import annotations

import torch

from speechattn.attention import build
from speechattn.attention.base import all_valid
from speechattn.attention.lsh import SCHEMES
from speechattn.bench.common import parser


def recall(name: str, hash: str, T: int, k: int, bits: int, batch: int, raw: bool) -> float:
    """Mean share of the selected keys that are among the top k by score (self excluded)."""
    torch.manual_seed(0)
    attn = build(name, 768, 12, k=k, bits=bits, hash=hash, normalize_keys=not raw).eval()
    x = torch.randn(batch, T, 768, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        q, keys, _ = attn._qkv(x)
        chosen = attn.select(q, keys, all_valid(x))  # (B, h, T, k)
        score = q @ keys.transpose(-1, -2)  # (B, h, T, T)
    score.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))  # self is not a candidate
    best = torch.zeros_like(score, dtype=torch.bool).scatter(-1, score.topk(k, -1).indices, True)
    own = chosen == torch.arange(T)[:, None]
    hits = best.gather(-1, chosen) & ~own
    return float(hits.sum() / (k * hits.shape[:-1].numel()))


def main(argv: list[str] | None = None) -> None:
    p = parser("lsh_recall", __doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[300, 1500])
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--raw-keys", action="store_true", help="normalize_keys=false")
    args = p.parse_args(argv)
    print(f"recall at k={args.k} of the top-k by score, {args.bits} hashes, B={args.batch}")
    print("scheme        hash  " + "".join(f"T={T:<8d}" for T in args.lengths))
    for name in SCHEMES:
        for hash in ("sign", "l2"):
            values = [
                recall(name, hash, T, args.k, args.bits, args.batch, args.raw_keys)
                for T in args.lengths
            ]
            print(f"{name:<13} {hash:<5} " + "".join(f"{v:<10.3f}" for v in values))
    print("random        -     " + "".join(f"{args.k / (T - 1):<10.3f}" for T in args.lengths))


if __name__ == "__main__":
    main()
