#!/usr/bin/env python3
"""Compile times of user programs: chorus's compiled and header-only forms against LibTorch.

Runs the exact compile commands CMake wrote for each program (compile_commands.json of a
Release build folder), one compile at a time, in interleaved rounds, and prints each command's
wall time and peak memory (median [min-max] over the rounds) and its ratio to the LibTorch peer
of the same program, per round. Nothing is linked. usage: see scripts/compile-times.sh.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# (program, form, CMake target, source file suffix); the LibTorch rows are the peers.
PROGRAMS = [
    ("README example", "compiled", "readme_example_compiled", "readme_example.cpp"),
    ("README example", "header-only", "readme_example_header_only", "readme_example.cpp"),
    ("README example", "LibTorch", "readme_example_libtorch", "readme_example_libtorch.cpp"),
    ("DataParallel tutorial", "compiled", "data_parallel_tutorial", "data_parallel_tutorial.cpp"),
    ("DataParallel tutorial", "header-only", "data_parallel_tutorial_header_only", "data_parallel_tutorial.cpp"),
    ("DataParallel tutorial", "LibTorch", "data_parallel_tutorial_libtorch", "data_parallel_tutorial_libtorch.cpp"),
    ("train_lm", "compiled", "train_lm", "train_lm.cpp"),
    ("train_lm", "header-only", "train_lm_header_only", "train_lm.cpp"),
    ("CUDA tutorial (g++, chorus::cuda_kernels)", "header-only", "data_parallel_tutorial_cuda",
     "data_parallel_tutorial.cpp"),
]


def find_command(entries, target, suffix):
    """The compile command of `suffix` in `target` (CMake's object path names the target)."""
    for e in entries:
        if e["file"].endswith(suffix) and f"/{target}.dir/" in e.get("output", e["command"]):
            return e
    return None


def time_compile(entry, out_dir):
    """(wall seconds, peak KB) of one run of the compile command, its object written to out_dir."""
    args = entry["arguments"] if "arguments" in entry else entry["command"].split()
    args = list(args)
    i = args.index("-o")
    args[i + 1] = os.path.join(out_dir, "out.o")
    while args and os.path.basename(args[0]) in ("ccache", "sccache"):  # time the compiler, not a cache
        args = args[1:]
    res_file = os.path.join(out_dir, "time.txt")
    cmd = ["/usr/bin/time", "-o", res_file, "-f", "%e %M"] + args
    p = subprocess.run(cmd, cwd=entry["directory"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"compile failed ({p.returncode}): {' '.join(args)}\n{p.stderr[-2000:]}")
    wall, kb = open(res_file).read().split()[-2:]
    return float(wall), int(kb)


def summary(xs, fmt):
    return f"{fmt(statistics.median(xs))} [{fmt(min(xs))}-{fmt(max(xs))}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", help="a Release build folder configured with CMAKE_EXPORT_COMPILE_COMMANDS=ON")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    entries = json.load(open(os.path.join(args.build, "compile_commands.json")))
    rows = []
    for prog, form, target, suffix in PROGRAMS:
        e = find_command(entries, target, suffix)
        if e is None:
            print(f"skipped: {prog} ({form}): target {target} is not in this build", file=sys.stderr)
            continue
        rows.append({"program": prog, "form": form, "target": target, "entry": e, "wall": [], "kb": []})
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for row in rows:  # interleaved: every program once per round
                wall, kb = time_compile(row["entry"], tmp)
                row["wall"].append(wall)
                row["kb"].append(kb)
                print(f"round {r + 1}: {row['program']} ({row['form']}): {wall:.2f} s, {kb / 1e6:.2f} GB",
                      file=sys.stderr, flush=True)
    peers = {row["program"]: row for row in rows if row["form"] == "LibTorch"}
    print(f"| program | form | wall time, s | peak memory, GB | time / LibTorch's (same round) |")
    print("|---|---|---|---|---|")
    for row in rows:
        peer = peers.get(row["program"])
        ratio = "-"
        if peer is not None and peer is not row:
            ratios = [a / b for a, b in zip(row["wall"], peer["wall"])]
            row["ratio"] = ratios
            ratio = summary(ratios, lambda v: f"{v:.2f}x")
        print(f"| {row['program']} | {row['form']} | {summary(row['wall'], lambda v: f'{v:.1f}')} | "
              f"{summary([k / 1e6 for k in row['kb']], lambda v: f'{v:.2f}')} | {ratio} |")
    if args.json:
        json.dump([{k: v for k, v in row.items() if k != "entry"} for row in rows], open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
