#!/usr/bin/env python3
"""Plots benchmark JSON (from chorus_bench, pytorch_gpu_bench.py) as one PNG: the ratio of each
chorus configuration to its peer, and DataParallel's speed-up over one device, each as the median
of per-round ratios with its min-max as an error bar (Note [paired rounds] in
benchmarks/bench_util.hpp).

usage: plot_benchmarks.py OUT.png BENCH.json [MORE.json ...]   (needs: pip install matplotlib)
       plot_benchmarks.py --markdown CPU.json    docs/performance.md's table and scaling line
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rounds import paired  # noqa: E402


def load(paths):
    """(records, ratios, scaling) of all files; ratios and scaling as chorus_bench writes them,
    or paired here from the records where a file has none (the GPU files)."""
    records, ratios, scaling, docs = [], [], [], []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if isinstance(doc, list):
            doc = {"records": doc}
        docs.append(doc)
        records += doc["records"]
        ratios += doc.get("ratios", [])
        scaling += doc.get("scaling", [])
    if not ratios:  # the GPU pair: chorus's file and PyTorch's, compared as compare_benchmarks.py does
        ours = [d for d in docs if any(r["impl"] == "chorus" for r in d["records"])]
        peers = [d for d in docs if any(r["impl"] != "chorus" for r in d["records"])]
        if ours and peers:
            from compare_benchmarks import compare
            for row in compare(ours[0], peers[0]):
                ratios.append(dict(workload=row["workload"], config=f"{row['chorus_config']} / {row['peer']}",
                                   ratio=dict(median=row["ratio"], min=row["ratio_min"], max=row["ratio_max"])))
    if not scaling:  # DataParallel k devices against 1, round by round
        for r in records:
            if r["impl"] != "chorus" or not r["config"].startswith("DataParallel") or r["devices"] < 2:
                continue
            one = [o for o in records if o["impl"] == "chorus" and o["workload"] == r["workload"]
                   and o["config"].startswith("DataParallel 1 ")]
            if one and len(one[0].get("round_ms", [])) == len(r.get("round_ms", [])) > 0:
                scaling.append(dict(workload=r["workload"], devices=r["devices"], speedup=paired(one[0], r)))
    return records, ratios, scaling


def plain_scaling(s):
    """A scaling entry of DataParallel itself (not its sharded step, nor its ceiling)."""
    return re.fullmatch(r"DataParallel \d+ dev x 1 thread", s.get("config", "DataParallel 2 dev x 1 thread")) is not None


def markdown(path):
    """chorus_bench's JSON as docs/performance.md's table: one row per chorus configuration, the peer at
    the same thread count, the ratio's median and min-max over the rounds; then the scaling."""
    with open(path) as f:
        doc = json.load(f)
    label = {"1 thread(s)": "1 thread", "2 thread(s)": "2 threads", "1 thread(s) bf16": "1 thread, bf16",
             "2 thread(s) bf16": "2 threads, bf16"}
    machine = doc.get("machine", {})
    peaks = machine.get("sgemm_peak_gflops", {})
    lines = []
    if "cpu" in machine:
        lines += [f"CPU: {machine['cpu']} ({machine['cores']} cores). GEMM: {machine['gemm']}. "
                  f"chorus's loops: {machine['cpu_capability']}. Peak (a 2048³ sgemm through that route): " +
                  ", ".join(f"{g:.0f} GFLOP/s on {t} thread{'s' if t != '1' else ''}" for t, g in peaks.items()) + ".",
                  ""]
    lines += [f"| workload | chorus configuration | chorus ms | LibTorch ms | ratio (median of {doc['rounds']} rounds) "
             "| min–max |", "|---|---|---:|---:|---:|---:|"]
    for q in doc["ratios"]:
        rec = next(r for r in doc["records"] if r["impl"] == "chorus" and r["workload"] == q["workload"]
                   and r["config"] == q["config"])
        m = re.match(r"DataParallel (\d+) dev x 1 thread", q["config"])
        config = label.get(q["config"], q["config"]) if not m else (
            "DataParallel, 1 device" if m[1] == "1" else f"DataParallel, {m[1]} devices × 1 thread")
        if "gflops" in rec:
            peak = peaks.get(str(q["threads"]))
            share = f", {100 * rec['gflops'] / peak:.0f} % of peak" if peak else ""
            config += f" ({rec['gflops']:.0f} GFLOP/s{share})"
        unit = "epoch" if q["workload"] == "tutorial" else "step"
        ms = lambda v: f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.1f}"
        r = q["ratio"]
        lines.append(f"| {q['workload']} ({unit}) | {config} | {ms(q['chorus_ms'])} | {ms(q['peer_ms'])} | "
                     f"{r['median']:.2f}× | {r['min']:.2f}–{r['max']:.2f} |")
    # The plain DataParallel rows by workload name; the sharded step and the ceiling (the
    # computation alone) named by their configuration.
    sc = [f"{s['workload']}{'' if plain_scaling(s) else ' (' + s['config'] + ')'} "
          f"{s['speedup']['median']:.2f}× ({s['speedup']['min']:.2f}–{s['speedup']['max']:.2f})"
          for s in doc["scaling"]]
    lines.append("")
    lines.append(f"DataParallel over {doc['scaling'][0]['devices'] if doc['scaling'] else 2} virtual CPU devices against "
                 f"one device, median of the per-round speed-ups (min–max): {', '.join(sc)}.")
    for q in doc.get("bf16_over_float32", []):
        r = q["ratio"]
        lines.append(f"bf16 {q['workload']}, {q['threads']} thread(s): bf16 / float32 step time {r['median']:.2f}× "
                     f"({r['min']:.2f}–{r['max']:.2f}).")
    return "\n".join(lines)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--markdown":
        print(markdown(sys.argv[2]))
        return
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = sys.argv[1]
    records, ratios, scaling = load(sys.argv[2:])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))

    # Left: chorus / peer per configuration, median of the rounds with min-max.
    ax = axes[0]
    labels = [f"{q['workload']}: {q['config']}" for q in ratios]
    med = [q["ratio"]["median"] for q in ratios]
    err = [[m - q["ratio"]["min"] for m, q in zip(med, ratios)], [q["ratio"]["max"] - m for m, q in zip(med, ratios)]]
    y = list(range(len(labels)))
    ax.barh(y, med, xerr=err, capsize=3, color=["tab:green" if m <= 1 else "tab:red" for m in med])
    ax.axvline(1.0, color="k", linestyle=":")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("chorus time / peer time (median of rounds, min-max; < 1: chorus faster)")
    ax.set_title("chorus against its peer at the same thread count")

    # Right: DataParallel speed-up against device count.
    ax = axes[1]
    scaling = [s for s in scaling if plain_scaling(s)]
    for w in dict.fromkeys(s["workload"] for s in scaling):
        pts = sorted((s["devices"], s["speedup"]) for s in scaling if s["workload"] == w)
        ds = [1] + [d for d, _ in pts]
        m = [1.0] + [s["median"] for _, s in pts]
        lo = [0.0] + [s["median"] - s["min"] for _, s in pts]
        hi = [0.0] + [s["max"] - s["median"] for _, s in pts]
        ax.errorbar(ds, m, yerr=[lo, hi], marker="o", capsize=3, label=w)
    if scaling:
        top = max(s["devices"] for s in scaling)
        ax.plot([1, top], [1, top], "k:", label="ideal")
    ax.set_xlabel("devices")
    ax.set_ylabel("speed-up over 1 device (median of rounds, min-max)")
    ax.set_title("DataParallel scaling")
    if scaling:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(records)} records)")


if __name__ == "__main__":
    main()
