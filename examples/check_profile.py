#!/usr/bin/env python3
"""Checks the examples' --profile traces and the trace scripts (scripts/merge_traces.py,
scripts/plot_trace.py) on them.

usage: check_profile.py dp  TRAIN_MLP OUT_DIR              train_mlp --cpu 2 --profile
       check_profile.py ddp TRAIN_MLP OUT_DIR MPIEXEC...   mpirun -np 2 train_mlp --distributed --profile

dp:  the trace has both devices' replica forwards, backward on both devices, gradient reductions
     with bytes, the optimizer step, memory counters and 5 steps; the summary is printed; the
     picture of a step is a PNG.
ddp: each rank's file names its rank; its communication lanes hold all-reduces with bytes; the
     merged file has both ranks, aligned; its picture is a PNG.
The pictures need matplotlib: without it the test is skipped (77), unless
CHORUS_REQUIRE_PYTHON_INTEROP=1 (CI), where it fails.
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "..", "scripts")
sys.path.insert(0, SCRIPTS)
import merge_traces  # noqa: E402


def fail(msg):
    print("check_profile: " + msg)
    sys.exit(1)


def run(cmd):
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(p.stdout + p.stderr)
    if p.returncode != 0:
        fail(f"exited with {p.returncode}")
    return p.stdout


def spans(trace):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def threads(trace):
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def check_picture(trace_path, png):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CHORUS_REQUIRE_PYTHON_INTEROP") == "1":
            fail("matplotlib is missing (pip install matplotlib)")
        print("check_profile: matplotlib missing, the pictures are not checked")
        sys.exit(77)
    run([sys.executable, os.path.join(SCRIPTS, "plot_trace.py"), trace_path, png])
    with open(png, "rb") as f:
        head = f.read(8)
    if head != b"\x89PNG\r\n\x1a\n" or os.path.getsize(png) < 10000:
        fail(f"{png} is not a picture of a step")


def check_dp(exe, out):
    path = os.path.join(out, "dp_trace.json")
    text = run([exe, "--cpu", "2", "--epochs", "1", "--profile", path])
    if "profile of 5 steps written to" not in text or "imbalance" not in text:
        fail("no profile summary in the output")
    with open(path) as f:
        trace = json.load(f)
    xs = spans(trace)
    steps = sorted({e["args"]["step"] for e in xs})
    if steps != [0, 1, 2, 3, 4]:
        fail(f"steps {steps}, expected 0-4")
    for step in steps:
        of = [e for e in xs if e["args"]["step"] == step]
        for r in (0, 1):
            if not any(e["name"] == f"forward replica {r}" and e["args"].get("device") == f"cpu:{r}" for e in of):
                fail(f"step {step}: no forward of replica {r}")
            if not any(e["cat"] == "backward" and e["args"].get("device") == f"cpu:{r}" for e in of):
                fail(f"step {step}: no backward on cpu:{r}")
        if not any(e["cat"] == "communication" and e["args"].get("bytes", 0) > 0 for e in of):
            fail(f"step {step}: no gradient reduction with bytes")
        if not any(e["cat"] == "optimizer" for e in of):
            fail(f"step {step}: no optimizer step")
        if not any(e["cat"] == "data" for e in of):
            fail(f"step {step}: no wait for the batch")
        # Layers by their dotted names (train_mlp's Mlp: net, a Sequential).
        if not any(e["cat"] == "forward" and e["name"] == "net.0" for e in of):
            fail(f"step {step}: no forward span of layer net.0")
    counters = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "C"}
    if not {"allocated cpu:0", "allocated cpu:1"} <= counters:
        fail(f"memory counters {counters}")
    check_picture(path, os.path.join(out, "dp_step.png"))


def check_ddp(exe, out, launcher):
    path = os.path.join(out, "ddp_trace.json")
    run(launcher + [exe, "--distributed", "--epochs", "1", "--profile", path])
    files = [os.path.join(out, f"ddp_trace.rank{r}.json") for r in (0, 1)]
    for r, f in enumerate(files):
        with open(f) as fh:
            trace = json.load(fh)
        procs = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
        if procs != [f"chorus rank {r}"]:
            fail(f"{f}: process name {procs}")
        names = threads(trace)
        reduces = [e for e in spans(trace) if e["cat"] == "communication" and e["name"] == "all_reduce"]
        if not reduces or any(e["args"].get("bytes", 0) <= 0 for e in reduces):
            fail(f"{f}: no all-reduce with bytes")
        if any(not names[(e["pid"], e["tid"])].startswith("comm lane ") for e in reduces):
            fail(f"{f}: an all-reduce off the communication lanes")
        if not any(e["cat"] == "backward" for e in spans(trace)):
            fail(f"{f}: no backward")
    merged = merge_traces.merge(files)
    if sorted({e["pid"] for e in merged["traceEvents"]}) != [0, 1]:
        fail("the merged trace does not hold both ranks")
    # Aligned: the ranks' step 2 starts within 0.5 s of each other (they meet at every all-reduce).
    starts = [min(e["ts"] for e in spans(merged) if e["pid"] == r and e["args"]["step"] == 2) for r in (0, 1)]
    if abs(starts[0] - starts[1]) > 5e5:
        fail(f"the ranks' step 2 starts {starts} us apart")
    merged_path = os.path.join(out, "ddp_merged.json")
    with open(merged_path, "w") as f:
        json.dump(merged, f)
    check_picture(merged_path, os.path.join(out, "ddp_step.png"))


def main():
    mode, exe, out = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out, exist_ok=True)
    if mode == "dp":
        check_dp(exe, out)
    elif mode == "ddp":
        check_ddp(exe, out, sys.argv[4:])
    else:
        fail("mode must be dp or ddp")
    print("check_profile: ok")


if __name__ == "__main__":
    main()
