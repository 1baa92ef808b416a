"""The printed tables and the log-log plot of `python -m speechattn.bench attention`'s result
(`speechattn.bench.attention.run`'s dict, or the JSON it writes)."""

from __future__ import annotations

from pathlib import Path


def print_table(out: dict) -> None:
    m, Ts, allrows = out["meta"], out["meta"]["lengths"], {**out["variants"], **out["baselines"]}
    w = max(len(n) for n in allrows) + 2
    header = "variant".ljust(w) + "".join(f"T={T}".rjust(10) for T in Ts)

    def table(title: str, key: str, fmt: str = "{:10.2f}", rows: dict = allrows,
              missing: str = f"{'-':>10}") -> None:  # fmt: skip
        print(f"\n{title}\n{header}")
        for n, r in rows.items():
            cells = (r.get(key, {}).get(T) for T in Ts)
            print(n.ljust(w) + "".join(missing if c is None else fmt.format(c) for c in cells))

    print(
        f"\n{m['device_name']}; {m['precision']}; matmul peak {m['matmul_peak_gflops']:.1f} GFLOP/s"
    )
    print(f"forward+backward {m['timing'].split()[1]} time (ms), B={m['batch']} D={m['dim']} "
          f"h={m['heads']} on {m['device']} ({m['threads']} threads)")  # fmt: skip
    print(header + "   exp")
    for n, r in allrows.items():
        cells = "".join(f"{r['time_ms'].get(T, float('nan')):10.1f}" for T in Ts)
        exp = r.get("growth_exponent")
        print(n.ljust(w) + cells + (f"  {exp:4.2f}" if exp is not None else "     -"))
    table("speed-up vs full (full time / variant time)", "ratio_to_full")
    table("FLOP bound: flops(full) / flops(variant)", "flop_bound")
    table("achieved / bound (speed-up over FLOP bound)", "achieved_of_bound")
    table("MFU (achieved FLOP/s over the measured matmul peak)", "mfu")
    table("kernels per step (CUDA launches; on the CPU operator calls from Python/autograd)",
          "kernels", "{:10d}")  # fmt: skip
    lsh = {n: r for n, r in allrows.items() if "attention_ms" in r}
    if lsh:
        print("\nLSH: hashing+matching (select) / attention part (ms)")
        for n, r in lsh.items():
            sel, att = r["select_ms"], r["attention_ms"]
            cells = "".join(f"{sel[T]:7.0f}/{att[T]:<7.0f}" for T in Ts if T in sel)
            exp = r["attention_growth_exponent"] or float("nan")
            print(f"{n.ljust(w)}{cells}  attention exp {exp:.2f}")
    two = {n: r for n, r in allrows.items() if set(r.get("kernel", {}).values()) - {"one"}}
    if two:
        how = "measured (*: here or cached)" if m.get("autotune") == "on" else "rule"
        table(f"kernel used (short: all T x T pairs, long: the sparse/band one; {how})",
              "kernel", "{:>10}", two)  # fmt: skip
    if any(r["peak_mem_mb"] for r in allrows.values()):
        table(f"peak memory (MiB; {m['memory']})", "peak_mem_mb", "{:10.1f}", missing="       n/a")
    print("\ntargets")
    missed = [c for c in out["targets"] if not c["met"]]
    for c in out["targets"]:
        if not c["met"] or len(out["targets"]) <= 40:
            val = "n/a" if c["value"] is None else f"{c['value']:.2f}"
            print(f"  [{'met' if c['met'] else 'MISSED'}] {c['target']}: {val}")
            if c.get("why"):
                print(f"      why: {c['why']}")
    print(f"  {len(out['targets']) - len(missed)} of {len(out['targets'])} met")


def plot(out: dict, path: Path) -> None:
    """Log-log time and memory vs T (also works on a JSON-loaded result with str keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    allrows = {**out["variants"], **out["baselines"]}
    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>pPX*hH"
    fig, axes = plt.subplots(1, 2, figsize=(14, 6))
    for i, (n, r) in enumerate(allrows.items()):
        style = dict(
            ls="--" if n in out["baselines"] else "-", marker=markers[i % len(markers)], ms=4
        )
        for ax, key in zip(axes, ("time_ms", "peak_mem_mb")):
            pts = sorted((int(T), t) for T, t in r.get(key, {}).items() if t)
            if pts:
                ax.plot(*zip(*pts), color=colors[i % len(colors)], label=n, **style)
    for ax, label in zip(axes, ("forward+backward time (ms)", "peak memory rise (MiB)")):
        ax.set(xscale="log", yscale="log", xlabel="T (frames)", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
    axes[1 if axes[1].lines else 0].legend(fontsize=8, ncol=2, loc="upper left")
    m = out["meta"]
    fig.suptitle(f"attention variants: B={m['batch']}, D={m['dim']}, h={m['heads']}, {m['device']}, "
                 f"{m['threads']} thread(s); {m['timing']}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
