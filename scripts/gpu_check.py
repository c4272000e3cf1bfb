#!/usr/bin/env python3
"""The work of scripts/gpu-check.sh (read its header first): pack what the GPU machine needs,
check it here (--dry-run), and run the GPU stages there in two device calls on one warm machine:
first the correctness part, then the speed part (Note [time budget]).

Only the chorus binaries get LD_LIBRARY_PATH (the carried libraries and the CUDA libraries
found on the machine); python3 and the PyTorch peer run with the environment they came with,
so PyTorch loads its own CUDA libraries.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CARRY = ".gpu-carry"  # the carried folder, relative to the repo root (ignored by git)
# Note [packed carry]: the carried folder holds one xz-compressed tar of the binaries and their
# libraries (and a copy of its MANIFEST.json), not the files themselves: OpenBLAS alone is 35 MB
# (4 MB packed) and the binaries 3-4 MB each, which unpacked left 2 MiB of the tool's 64 MiB.
# The run unpacks it first into a new temporary folder (unpack_carry, the same code in the dry
# run, its time counted in the budget) and every stage runs from there: BUILD/tests/...,
# BUILD/lib (carried first on LD_LIBRARY_PATH), BUILD/lib-fallback, as in the folder packed.
# xz through Python's tarfile/lzma, because python3 is on every GPU machine; an xz or zstd tool
# may not be.
ARCHIVE = "chorus-gpu.tar.xz"
# The GPU test programs (each a GoogleTest binary, each its own stage, in this order), then the
# other programs the stages run.
TEST_BINARIES = ["tests/test_cuda", "tests/test_cuda_layers", "tests/test_cuda_ops"]
# DistributedDataParallel over NCCL (built where MPI is found; on the GPU machine they run under
# torchrun's environment, which needs no MPI launcher, and under mpirun where it exists).
DIST_BINARIES = ["tests/distributed/test_distributed_cuda", "examples/train_mlp_cuda"]
BINARIES = (TEST_BINARIES + ["examples/data_parallel_tutorial_cuda", "examples/train_lm_cuda", "benchmarks/chorus_gpu_bench"] +
            DIST_BINARIES)
# The benchmark stage's driver (PyTorch's rounds alternating with chorus_gpu_bench --serve's) and
# the comparison of its two JSON files.
BENCH_DRIVER = os.path.join(REPO, "benchmarks/pytorch_gpu_bench.py")
COMPARE = os.path.join(REPO, "scripts/compare_benchmarks.py")
# What compute-sanitizer memcheck runs: the tests whose kernels index memory (elementwise,
# reductions, products, copies and views, the layers, the sequence-model operators with their
# gathers, scatters and selections), not the ones about streams, events, the allocator or NCCL
# (slowed ten- to a hundredfold they time nothing and use up the budget: all of test_cuda does not
# finish under memcheck in the 150 s or so that the stages before may leave it). The typed tests
# in float only (Suite/0.*: the double instantiation runs the same index arithmetic) and not the
# convolutions (cuDNN's kernels, not ours, and the slowest under memcheck).
MEMCHECK_PLAN = [
    ("tests/test_cuda", "CudaOps/0.*:Cuda.MoreThan65535RowsAndTwoDimensionalReductions:Cuda.AnMlpTrainingStepMatchesTheCpu:"
                        "Cuda.LinearOnMisalignedOperandsFallsBackOrRunsAligned:Cuda.AmsgradMaxKeepsNaN"),
    ("tests/test_cuda_layers", "CudaLayers/0.Pooling:CudaLayers/0.Normalisation:CudaLayers/0.BatchNorm*:"
                               "CudaLayers/0.DropoutMaskIsTheCpuMaskBitForBit:CudaLayers/0.ClipGradNormMatchesTheCpu"),
    ("tests/test_cuda_ops", "CudaSeqOps/0.*"),
]  # typed tests are named Suite/0.Test (the dry run checks that each pattern matches)


def memcheck_plan_problems(build, env, plan=None):
    """Each pattern of the memcheck plan must name tests of its binary (a typo would run none)."""
    problems = []
    for rel, gtest_filter in plan or MEMCHECK_PLAN:
        for pattern in gtest_filter.split(":"):
            r = subprocess.run([os.path.join(build, rel), "--gtest_list_tests", "--gtest_filter=" + pattern],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0 or not any(l.startswith("  ") for l in r.stdout.splitlines()):
                problems.append(f"memcheck plan: {rel} has no test matching {pattern!r}")
    return problems


def serve_problems(build, env):
    """The benchmark stage drives chorus_gpu_bench --serve; a build from before the interleaved
    benchmarks (which took no --serve) would pass every other check and fail only on the GPU.
    Probed with --serve --rounds 0: the current one reads its options first and refuses the zero
    rounds by name, before it looks for a GPU (an older one says it needs a GPU or chokes on
    --serve); either way it exits at once."""
    exe = os.path.join(build, "benchmarks/chorus_gpu_bench")
    try:
        r = subprocess.run([exe, "--serve", "--rounds", "0"], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, env=env, timeout=60)
        said = r.stdout + r.stderr
    except Exception as e:
        said = str(e)
    if "--rounds must be at least 1" in said:
        return []
    return [f"benchmarks/chorus_gpu_bench does not take --serve (a build from before the interleaved benchmarks?): "
            f"{said.strip()[-300:]!r}"]


# The device tool's limits (/work/.library/device/README.md).
TREE_LIMIT = 64 << 20       # the working tree that travels, carried paths included
TREE_MARGIN = 8 << 20       # headroom for files added after the dry run (an issue note, a log, a wheel)
MAX_OUT_FILES = 8           # files back from $OUT
MAX_OUT_FILE_BYTES = 16 << 20
BUDGET_S = 240              # each part, one device call (two fit one 15-minute loan with a rerun)
# Note [time budget]: the check is two device calls on one warm machine, each with its own
# budget and summary: first `correctness` (the CUDA tests with their reruns, the tutorial, a
# short train_lm, DDP over NCCL), then `speed` (the benchmarks against PyTorch, then
# compute-sanitizer memcheck). A failure in the first leaves the time to fix, rebuild and rerun
# it before the second. Inside a part, a stage's limit is min(its cap, the time left less what
# it keeps for the stages after it), at least 5 s; what a stage keeps is the sum of the later
# stages' floors, and the floors add up to BUDGET_S. So each stage gets at least its floor
# however long the ones before it ran (each is killed at its limit), and the part ends inside
# BUDGET_S (the 5 s minimum aside, which binds only when the in-process work between stages ate
# a later floor). The unpack of the carried archive (Note [packed carry], about 1 s, in each
# part) and that in-process work come out of the next stage's share; memcheck, last, gets the
# rest, split evenly between its binaries.
#   part         stage               cap  floor  keeps
#   correctness  test_cuda           100     70    170
#                test_cuda_layers     45     30    140
#                test_cuda_ops        45     30    110
#                tutorial             30     15     95
#                train_lm             45     25     70
#                distributed          90     70      0   (gpu-check-distributed.sh: the limit less 10 s)
#   speed        benchmarks          120    120    120   (the driver keeps 10 s more: compare_benchmarks.py's)
#                memcheck           rest    120      0
# Reruns (after each test stage, every failed, crashed or GPU-skipped test alone with
# CHORUS_DEBUG_SYNC=1): 45 s each, 60 s per binary, only from the time above what that test stage
# keeps ("not rerun (time)" when under 15 s of it is left). When the early stages are quick the
# later ones get up to their caps; the caps add up to more than the budget. TestBudget in
# tests/scripts/test_gpu_check.py checks this with a fake clock.
PLANS = {  # part: [(stage, cap, floor)], in the order gpu_run runs them; cap None: the rest
    "correctness": [
        ("tests/test_cuda", 100, 70),
        ("tests/test_cuda_layers", 45, 30),
        ("tests/test_cuda_ops", 45, 30),
        ("tutorial", 30, 15),
        ("train_lm", 45, 25),
        ("distributed", 90, 70),
    ],
    "speed": [
        ("benchmarks", 120, 120),
        ("memcheck", None, 120),
    ],
}
PARTS = list(PLANS)
RERUN_EACH_S, RERUN_BINARY_S, RERUN_MIN_S = 45, 60, 15
COMPARE_S = 10  # compare_benchmarks.py, inside the benchmarks' floor


def part_of(stage):
    """The part whose plan has `stage` (stage names are unique across the parts), or None."""
    return next((part for part, plan in PLANS.items() if any(n == stage for n, _, _ in plan)), None)


def time_cap(stage, default=None):
    return next((cap for n, cap, _ in PLANS.get(part_of(stage), []) if n == stage), default)


def time_keep(stage):
    """What `stage` keeps for the later stages of its part: the sum of their floors (0 if not planned)."""
    plan = PLANS.get(part_of(stage), [])
    names = [n for n, _, _ in plan]
    return sum(f for _, _, f in plan[names.index(stage) + 1:]) if stage in names else 0


# Libraries the GPU machine provides: the C runtime (never carried: it must match the kernel
# and the loader there) and the CUDA libraries, from the toolkit or from PyTorch's wheels.
# cuDNN is one of them: libcudnn.so.9 loads its sub-libraries (engines, graph, heuristics,
# hundreds of MiB) at run time from its own folder, so a carried libcudnn.so.9 would mix with
# whatever cuDNN the machine has; the machine's own serves, and the libraries stage names it.
SYSTEM_LIB = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|libresolv)\b[.\w-]*\.so")
CUDA_LIB = re.compile(r"^lib(cuda|cudart|cublas|cublasLt|nccl|nvidia-\w+|nvrtc|nvJitLink|cudnn\w*)\.so")
# The C++ runtime: every machine with python3 and PyTorch has one, normally newer than the
# compiler's here. It is packed into lib-fallback/ and used only where the machine's own lacks
# a version the binaries need: put first for everything, an older libstdc++ would also be
# loaded by compute-sanitizer (which runs with the binaries' environment) and could break it.
FALLBACK_LIB = re.compile(r"^lib(stdc\+\+|gcc_s)\.so")
# What libcudnn.so.9 loads from its own folder when a convolution first runs.
CUDNN_SUBLIBS = ["libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_engines_runtime_compiled.so.9",
                 "libcudnn_heuristic.so.9", "libcudnn_ops.so.9", "libcudnn_cnn.so.9"]


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# Where things are


def cuda_lib_dirs():
    """Directories that may hold the CUDA libraries on this machine, most specific first: next
    to nvcc, the toolkit's usual places, and the nvidia wheels in python3's site-packages."""
    dirs = []
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if os.path.exists(nvcc) else "/usr/local/cuda"
    for base in (root, "/usr/local/cuda"):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            dirs.append(os.path.join(base, sub))
    try:  # python3's nvidia-* wheels (PyTorch's CUDA libraries): nvidia/<pkg>/lib, nvidia/cu13/lib
        out = subprocess.run([sys.executable, "-c",
                              "import nvidia, os\n"
                              "for p in nvidia.__path__:\n"
                              "  for d in sorted(os.listdir(p)):\n"
                              "    l = os.path.join(p, d, 'lib')\n"
                              "    if os.path.isdir(l): print(l)"],
                             capture_output=True, text=True, timeout=30)
        dirs += out.stdout.split()
    except Exception:
        pass
    seen, result = set(), []
    for d in dirs:
        r = os.path.realpath(d)
        if os.path.isdir(r) and r not in seen:
            seen.add(r)
            result.append(r)
    return result


def find_sanitizer():
    """compute-sanitizer next to nvcc first (the matching version), then the usual places."""
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "compute-sanitizer"))
        cands.append(os.path.join(os.path.dirname(nvcc), "compute-sanitizer"))
    if shutil.which("compute-sanitizer"):
        cands.append(shutil.which("compute-sanitizer"))
    cands += ["/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"]
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


_FALLBACK_NEEDED = {}


def fallback_needed(build, paths):
    """True when a binary does not load with the machine's own C++ runtime."""
    if build not in _FALLBACK_NEEDED:
        env = dict(os.environ, LD_LIBRARY_PATH=":".join(paths))
        out = subprocess.run(["ldd", os.path.join(build, BINARIES[0])], capture_output=True, text=True, env=env)
        _FALLBACK_NEEDED[build] = "not found" in out.stdout + out.stderr
    return _FALLBACK_NEEDED[build]


def chorus_env(build, extra=None):
    """The environment of a chorus binary: carried libraries first, then the CUDA libraries."""
    env = dict(os.environ)
    paths = []
    lib = os.path.join(build, "lib")
    if os.path.isdir(lib):
        paths.append(os.path.abspath(lib))
    paths += cuda_lib_dirs()
    fallback = os.path.join(build, "lib-fallback")
    if os.path.isdir(fallback) and fallback_needed(build, paths):
        paths.insert(1, os.path.abspath(fallback))
    if env.get("LD_LIBRARY_PATH"):
        paths.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(paths)
    env.update(extra or {})
    return env


def ldd(binary, env):
    """{soname: resolved path or None} for every library `binary` loads."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, env=env).stdout
    libs = {}
    for line in out.splitlines():
        line = line.strip()
        m = re.match(r"^(\S+) => (not found|(\S+)) ?", line)
        if m:
            libs[m.group(1)] = None if m.group(2) == "not found" else m.group(3)
        elif line and "=>" not in line:
            name = line.split()[0]
            libs[os.path.basename(name)] = name
    return libs


def session_members(sid):
    """Pids of the processes in session `sid` (from /proc: field 6 of stat is the session)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        if len(fields) > 3 and int(fields[3]) == sid:
            pids.append(int(d))
    return pids


def kill_session(sid):
    """SIGKILLs every process of the session a stage started (start_new_session=True makes one per
    command). Not the process group: GNU timeout (and mpirun) put their children into groups of
    their own, which a killpg misses; they stay in the session."""
    for _ in range(20):  # members may fork while we look
        pids = [p for p in session_members(sid) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def has_gpu():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return "GPU" in out
    except Exception:
        return False


def tree_bytes():
    """Bytes of the working tree that travels: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "-c", "-o", "--exclude-standard"], capture_output=True,
                         text=True).stdout
    total = 0
    for f in out.split("\0"):
        p = os.path.join(REPO, f)
        if f and os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
    return total


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


# ---------------------------------------------------------------------------------------------
# Packing and the dry run (here, no GPU needed)


def pack(build, staging):
    """Copies the binaries and every library they load that the GPU machine may lack into
    `staging`, the layout the stages expect (Note [packed carry])."""
    if os.path.isdir(staging):
        shutil.rmtree(staging)
    os.makedirs(os.path.join(staging, "lib"))
    os.makedirs(os.path.join(staging, "lib-fallback"))
    manifest = {"binaries": {}, "libs": {}, "fallback_libs": {}}
    env = dict(os.environ)
    for b in BINARIES:
        src = os.path.join(build, b)
        if not os.path.isfile(src):
            raise SystemExit(f"gpu-check: {src} is missing: build it first (cmake --build {build} --target "
                             f"{os.path.basename(b)})")
        dst = os.path.join(staging, b)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
        manifest["binaries"][b] = os.path.getsize(dst)
        for name, path in ldd(src, env).items():
            if SYSTEM_LIB.match(name) or CUDA_LIB.match(name):
                continue
            if path is None:
                raise SystemExit(f"gpu-check: {src} needs {name}, which is not found here either")
            fallback = bool(FALLBACK_LIB.match(name))
            out = os.path.join(staging, "lib-fallback" if fallback else "lib", name)
            if not os.path.exists(out):
                shutil.copy2(os.path.realpath(path), out)  # the file itself, under its soname
                manifest["fallback_libs" if fallback else "libs"][name] = os.path.getsize(out)
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    manifest["commit"] = head
    manifest["packed"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest["unpacked_bytes"] = dir_bytes(staging)
    with open(os.path.join(staging, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def write_archive(staging, carry):
    """`carry` afresh, holding ARCHIVE (xz-compressed tar of `staging`'s contents) and a copy
    of MANIFEST.json beside it (Note [packed carry]). Returns the archive's size in bytes."""
    if os.path.isdir(carry):
        shutil.rmtree(carry)
    os.makedirs(carry)
    tmp = os.path.join(carry, ARCHIVE + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        for name in sorted(os.listdir(staging)):
            tar.add(os.path.join(staging, name), arcname=name)  # directories in sorted order
    os.replace(tmp, os.path.join(carry, ARCHIVE))
    shutil.copy2(os.path.join(staging, "MANIFEST.json"), os.path.join(carry, "MANIFEST.json"))
    return os.path.getsize(os.path.join(carry, ARCHIVE))


def have_lzma():
    try:
        import lzma  # noqa: F401  (a Python built without liblzma has none)
        return True
    except ImportError:
        return False


def unpack_carry(carry):
    """Unpacks carry/ARCHIVE into a new temporary folder and returns that folder. Python's lzma
    does it; without one (a Python built without liblzma) an xz tool on PATH decompresses."""
    dest = tempfile.mkdtemp(prefix="chorus-gpu-carry-")
    archive = os.path.join(carry, ARCHIVE)
    xz = None
    try:
        if have_lzma():
            tar = tarfile.open(archive, "r:xz")
        else:
            if not shutil.which("xz"):
                raise RuntimeError("this python3 has no lzma module and there is no xz tool on PATH")
            xz = subprocess.Popen(["xz", "-dc", archive], stdout=subprocess.PIPE)
            tar = tarfile.open(fileobj=xz.stdout, mode="r|")
        with tar:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4/3.12: no path outside dest
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest)
        if xz and xz.wait() != 0:
            raise RuntimeError(f"xz -dc {archive} exited with status {xz.returncode}")
    except BaseException:
        if xz:
            xz.kill()
            xz.wait()
        shutil.rmtree(dest, ignore_errors=True)
        raise
    finally:
        if xz:
            xz.stdout.close()
    return dest


def tree_listing(d):
    """{relative path: (size, executable)} of every file under d."""
    return {os.path.relpath(os.path.join(r, f), d): (os.path.getsize(os.path.join(r, f)),
                                                      os.access(os.path.join(r, f), os.X_OK))
            for r, _, fs in os.walk(d) for f in fs}


def verify(build, carry):
    """What the device call relies on, checked here on `carry`, the folder unpacked from the
    archive as on the GPU machine. Returns a list of problems."""
    problems = []
    # As on a machine whose C++ runtime is too old: the fallback folder in use too.
    env = chorus_env(carry)
    env["LD_LIBRARY_PATH"] = os.path.abspath(os.path.join(carry, "lib-fallback")) + ":" + env["LD_LIBRARY_PATH"]
    carry_lib = os.path.realpath(os.path.join(carry, "lib"))
    carry_fallback = os.path.realpath(os.path.join(carry, "lib-fallback"))
    cuda_dirs = cuda_lib_dirs()
    for b in BINARIES:
        path = os.path.join(carry, b)
        libs = ldd(path, env)
        for name, where in libs.items():
            if where is None:
                problems.append(f"{b}: {name} not found")
            elif SYSTEM_LIB.match(name):
                continue
            elif CUDA_LIB.match(name):
                if not any(os.path.realpath(where).startswith(d + os.sep) for d in cuda_dirs):
                    problems.append(f"{b}: CUDA library {name} resolved outside the CUDA directories: {where}")
            elif not (os.path.realpath(where).startswith(carry_lib + os.sep) or
                      os.path.realpath(where).startswith(carry_fallback + os.sep)):
                problems.append(f"{b}: {name} resolves to {where}, not to the carried {carry}/lib")
        # One CUDA runtime: the shared one, and no static copy linked in (CUDA_RUNTIME_LIBRARY Shared).
        if not any(n.startswith("libcudart.so") for n in libs):
            problems.append(f"{b}: does not load libcudart.so (static cudart only?)")
        nm = subprocess.run(["nm", path], capture_output=True, text=True).stdout
        if re.search(r"^\S+ T cudaMalloc$", nm, re.M) or "cudart::" in nm:
            problems.append(f"{b}: the static CUDA runtime is linked in as well")
        link = os.path.join(build, os.path.dirname(b), "CMakeFiles", os.path.basename(b) + ".dir", "link.txt")
        if os.path.isfile(link) and "cudart_static" in open(link).read():
            problems.append(f"{b}: its link line names cudart_static ({link})")
    r = subprocess.run([os.path.join(carry, "tests/test_cuda"), "--gtest_list_tests"], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0 or "Cuda." not in r.stdout:
        problems.append(f"test_cuda does not start with the carried environment: {r.stderr[-500:]}")
    return problems


def size_problems(carry):
    """The working tree plus the packed carry folder must fit the tool's limit, less the margin.
    Returns (problems, total bytes)."""
    problems = []
    total = tree_bytes() + dir_bytes(carry)
    if total > TREE_LIMIT - TREE_MARGIN:
        problems.append(f"working tree + {carry} = {total / 2**20:.1f} MiB, over the device tool's "
                        f"{TREE_LIMIT >> 20} MiB (less {TREE_MARGIN >> 20} MiB headroom)")
    extra = sorted(set(os.listdir(carry)) - {ARCHIVE, "MANIFEST.json"})
    if extra:
        problems.append(f"{carry} holds more than the archive and its manifest: {extra}")
    ignored = subprocess.run(["git", "-C", REPO, "check-ignore", "-q", CARRY]).returncode == 0
    if not ignored:
        problems.append(f"{CARRY} is not ignored by git (it must travel as a carried path, not as tree files)")
    return problems, total


def check_out_dir(out):
    """The files the device tool will return: at most 8, 16 MiB each, 2 folders deep, plain names."""
    problems = []
    files = []
    for r, ds, fs in os.walk(out):
        for f in fs:
            p = os.path.join(r, f)
            rel = os.path.relpath(p, out)
            files.append(rel)
            if rel.count(os.sep) > 2:
                problems.append(f"$OUT/{rel} is more than 2 folders down")
            if not re.fullmatch(r"[A-Za-z0-9._-]+", f):
                problems.append(f"$OUT/{rel}: a name the tool will not return")
            if os.path.getsize(p) > MAX_OUT_FILE_BYTES:
                problems.append(f"$OUT/{rel} is over 16 MiB")
    if len(files) > MAX_OUT_FILES:
        problems.append(f"$OUT holds {len(files)} files; the tool returns {MAX_OUT_FILES}")
    return problems, files


# ---------------------------------------------------------------------------------------------
# The stages


def gtest_verdict(r, gpu, dry=False):
    """(verdict, ok) of one gtest run (gtest() or parse_gtest results). A run passes only with
    exit status 0, its JSON report, no failed or crashed test, at least one test passed, and on a
    GPU machine no skipped test; a dry run (no GPU) may skip every test. Anything else says what
    happened: a binary that cannot start (exit 127: a missing library) wrote no report; one that
    crashed after writing it (SIGSEGV at exit) has a report and a bad exit status."""
    rc, ran = r.get("rc", 0), r["passed"] + len(r["failed"])
    if r.get("timed_out"):
        return "timed out", False
    if not r.get("report") and not ran and not r["skipped"] and not r["crashed"]:
        return f"did not start (exit status {rc})", False
    if r["crashed"]:
        return f"crashed ({len(r['crashed'])} test(s), exit status {rc})", False
    if r["failed"]:
        return f"failed ({len(r['failed'])} test(s))", False
    if rc != 0:
        return f"failed (exit status {rc}{' after writing its report' if r.get('report') else ''})", False
    if not r.get("report"):
        return "failed (no JSON report)", False
    if r["skipped"] and gpu:
        return f"failed ({len(r['skipped'])} test(s) skipped on the GPU)", False
    if not r["passed"]:
        if dry and r["skipped"]:
            return "passed (dry run: every test skipped, no GPU)", True
        return "failed (ran no test)", False
    if not gpu and not dry:
        return "failed (no GPU: the tests skipped)", False
    return "passed", True


def program_verdict(rc, timed_out, ok, why):
    """The verdict of a program that is not a test binary (tutorial, benchmarks, train_mlp)."""
    if timed_out:
        return "timed out"
    if ok:
        return "passed"
    if rc == 127:
        return "did not start (exit status 127: a missing library?)"
    return f"failed (exit status {rc}{', ' + why if why and rc == 0 else ''})"


def tutorial_verdict(rc, timed_out, text):
    """The tutorial run with --gpus (which exits with an error where no GPU is found): it passes
    when it exits 0 and prints its batches. It says "Let's use N GPUs!" only for more than one
    device, as PyTorch's tutorial does, so one GPU prints no such line; a line naming CPU devices
    means it did not run on the GPUs."""
    batches = len(re.findall(r"^Outside: input size", text, re.M))
    on_cpu = re.search(r"^Let's use \d+ CPU devices!", text, re.M) is not None
    ok = rc == 0 and not timed_out and batches > 0 and not on_cpu
    why = "ran on CPU devices, not the GPUs" if on_cpu else "no batch printed"
    return program_verdict(rc, timed_out, ok, why), ok


# train_lm's stage: a small transformer for a few steps on every GPU, on the repository's LICENSE.
TRAIN_LM_ARGS = ["--model", "transformer", "--gpus", "--epochs", "1", "--steps", "30", "--batch", "16",
                 "--seq-len", "32", "--sample", "40", "--data", os.path.join(REPO, "LICENSE")]
VAL_LOSS = re.compile(r"val loss ([0-9.]+|nan|inf)")  # train_lm's validation losses, in order


def train_lm_verdict(rc, timed_out, text):
    """train_lm_cuda for a few steps: it passes when it exits 0, ran on the GPUs, and its
    validation loss after training is below the untrained model's ("before training: val loss
    X", then "epoch N: val loss Y")."""
    losses = [float(v) for v in VAL_LOSS.findall(text)]
    on_gpu = re.search(r"on \d+ device\(s\):( cuda:\d+)+\s*$", text, re.M) is not None
    learned = len(losses) >= 2 and losses[-1] < losses[0]
    ok = rc == 0 and not timed_out and on_gpu and learned
    why = ("did not run on the GPUs" if not on_gpu else
           f"the validation loss did not fall ({' -> '.join(f'{v:.4f}' for v in losses) or 'none printed'})")
    return program_verdict(rc, timed_out, ok, why), ok


def bench_row_names():
    """"workload config vs peer" of every row compare_benchmarks.py looks for (its TARGETS)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import compare_benchmarks
    return [f"{w} {cc} vs {pi} {pc}" for w, cc, pi, pc, _ in compare_benchmarks.TARGETS]


def ratio_line(r):
    """One compared row: the median of its per-round ratios with their min-max ("paired"), or
    the ratio of the two medians where the rounds could not be paired ("unpaired")."""
    spread = (f"{r['ratio']:.2f}x [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] paired" if r.get("paired")
              else f"{r['ratio']:.2f}x unpaired")
    target = "" if r.get("target") is None else f", target <= {r['target']} {'met' if r.get('met') else 'MISSED'}"
    return f"{r['workload']} {r['chorus_config']} vs {r['peer']}: {spread}{target}"


def error_text(e):
    """One error a benchmark recorded ({"workload", "config", "error"}), on one short line."""
    if not isinstance(e, dict):
        return str(e)[:160]
    where = " ".join(str(e[k]) for k in ("workload", "config") if e.get(k))
    return ((where + ": " if where else "") + str(e.get("error", "")))[:160]


def counts(r):
    """The counts every test stage reports."""
    return {"ran": r["passed"] + len(r["failed"]), "passed": r["passed"], "failed": len(r["failed"]),
            "skipped": len(r["skipped"]), "crashed": len(r["crashed"]), "timed_out": bool(r.get("timed_out"))}


def out_files(part):
    """The two files a part writes into OUTDIR: its summary and its logs."""
    return f"summary-{part}.json", f"logs-{part}.tar.gz"


class Run:
    def __init__(self, out, build, gpu, dry, part):
        self.out, self.build, self.gpu, self.dry, self.part = out, build, gpu, dry, part
        self.t0 = time.monotonic()
        # Raw logs live outside $OUT (the tool returns 8 files): archived after every stage.
        self.logs = tempfile.mkdtemp(prefix="gpu-check-logs-")
        self.unpacked = None  # the temporary folder unpack_stage made, removed by cleanup()
        self.summary = {"status": "running", "part": part, "gpu_machine": gpu, "dry_run": dry, "budget_s": BUDGET_S,
                        "build": build, "stages": {}}
        self.read_manifest(build)
        self.failed = False

    def read_manifest(self, folder):
        path = os.path.join(folder, "MANIFEST.json")
        if os.path.isfile(path):
            with open(path) as f:
                self.summary["packed"] = json.load(f).get("commit")

    def cleanup(self):
        shutil.rmtree(self.logs, ignore_errors=True)
        if self.unpacked:
            shutil.rmtree(self.unpacked, ignore_errors=True)

    def left(self):
        return BUDGET_S - (time.monotonic() - self.t0)

    def timeout(self, cap, reserve=0):
        return max(5, min(cap, self.left() - reserve))

    def limit(self, stage, cap=None):
        """A planned stage's limit (Note [time budget]): min(cap, time left - what it keeps)."""
        return self.timeout(time_cap(stage) if cap is None else cap, reserve=time_keep(stage))

    def exe(self, rel):
        return os.path.join(self.build, rel)

    def run(self, name, cmd, timeout, env=None, log_name=None):
        """Runs cmd with stdout+stderr into logs/<log_name>, killing its process group on timeout."""
        path = os.path.join(self.logs, log_name or f"{name}.log")
        t = time.monotonic()
        with open(path, "ab") as f:
            f.write(f"$ {' '.join(cmd)}\n".encode())
            f.flush()
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                 cwd=REPO)
            try:
                rc = p.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                kill_session(p.pid)
                rc = p.wait()
                timed_out = True
                f.write(f"\n[gpu-check: killed after {timeout:.0f} s]\n".encode())
            kill_session(p.pid)  # what it left running (a background child) goes too
        return rc, timed_out, time.monotonic() - t, path

    def stage(self, name, result, ok):
        result["ok"] = ok
        result.setdefault("verdict", "passed" if ok else "failed")
        result["elapsed_total_s"] = round(time.monotonic() - self.t0, 1)
        self.summary["stages"][name] = result
        c = result.get("counts")
        self.summary.setdefault("verdicts", {})[name] = result["verdict"] + (
            f" (ran {c['ran']}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
            f"{', ' + str(c['crashed']) + ' crashed' if c['crashed'] else ''}"
            f"{', timed out' if c['timed_out'] else ''})" if c else "")
        if not ok:
            self.failed = True
        self.save()
        log(f"== {name}: {'ok' if ok else 'FAILED'} {json.dumps({k: v for k, v in result.items() if k != 'ok'})[:600]}")

    def save(self, final=False):
        """summary-PART.json and logs-PART.tar.gz, rewritten after every stage (a timeout keeps what ran)."""
        if final:
            self.summary["status"] = "failed" if self.failed else "ok"
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        summary, logs = out_files(self.part)
        tmp = os.path.join(self.out, summary + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.summary, f, indent=2)
        os.replace(tmp, os.path.join(self.out, summary))
        tmp = os.path.join(self.out, logs + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.logs, arcname="logs")
        os.replace(tmp, os.path.join(self.out, logs))

    # -- gtest helpers

    @staticmethod
    def parse_gtest(json_path, log_path):
        """(passed, failed, skipped, seen, crashed) from gtest's JSON, or from its log after a crash."""
        passed, failed, skipped, seen = [], [], [], []
        if json_path and os.path.isfile(json_path):
            try:
                with open(json_path) as f:
                    t = json.load(f)
                for s in t.get("testsuites", []):
                    for c in s.get("testsuite", []):
                        name = f"{s['name']}.{c['name']}"
                        seen.append(name)
                        if c.get("result") == "SKIPPED" or c.get("status") == "NOTRUN":
                            skipped.append(name)
                        elif c.get("failures"):
                            failed.append(name)
                        else:
                            passed.append(name)
                return passed, failed, skipped, seen, None
            except Exception:
                pass
        text = ""
        if os.path.isfile(log_path):
            with open(log_path, errors="replace") as f:
                text = f.read()
        running = None
        for line in text.splitlines():
            m = re.match(r"^\[ RUN      \] (\S+)", line)
            if m:
                running = m.group(1)
                seen.append(running)
                continue
            m = re.match(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+) \(", line)
            if m:
                {"OK": passed, "FAILED": failed, "SKIPPED": skipped}[m.group(1)].append(m.group(2))
                if m.group(2) == running:
                    running = None
        return passed, failed, skipped, seen, running

    def gtest(self, label, binary, env, cap, extra_args=(), prefix=(), gtest_filter=None, keep=0):
        """Runs a gtest binary within one limit, min(cap, time left - keep); after a crash,
        records the crashed test and resumes after it inside the same limit. `report` says whether
        the last run wrote its JSON report; `rc` is the first non-zero exit status (negative:
        killed by that signal)."""
        deadline = time.monotonic() + self.timeout(cap, reserve=keep)
        passed, failed, skipped, crashed, excluded = [], [], [], [], []
        attempt = 0
        rc_all = 0
        timed_out = False
        report = False
        while True:
            attempt += 1
            jpath = os.path.join(self.logs, f"{label}-{attempt}.json")
            args = list(prefix) + [binary, f"--gtest_output=json:{jpath}"] + list(extra_args)
            if gtest_filter or excluded:
                args.append("--gtest_filter=" + (gtest_filter or "*") + ("-" + ":".join(excluded) if excluded else ""))
            rc, to, _, lpath = self.run(label, args, max(1, deadline - time.monotonic()), env=env,
                                        log_name=f"{label}-{attempt}.log")
            p, f, s, seen, crash = self.parse_gtest(jpath, lpath)
            report = os.path.isfile(jpath)
            passed += p
            failed += f
            skipped += s
            rc_all = rc_all or rc
            if to:
                timed_out = True
                if crash:
                    crashed.append(crash + " (timed out)")
                break
            if report or not crash or attempt >= 4 or self.left() < 30 or deadline - time.monotonic() < 10:
                if crash and not report:
                    crashed.append(crash)
                break
            crashed.append(crash)  # resume with the rest
            excluded += seen
        return {"passed": len(passed), "failed": failed, "skipped": skipped, "crashed": crashed, "rc": rc_all,
                "timed_out": timed_out, "report": report, "runs": attempt}

    # -- stages

    def ldd_stage(self):
        env = chorus_env(self.build)
        missing, cudnn = {}, set()
        for b in BINARIES:
            if not os.path.isfile(self.exe(b)):
                missing[b] = ["(binary missing)"]
                continue
            found = ldd(self.exe(b), env)
            m = [n for n, w in found.items() if w is None]
            for n, w in found.items():
                if w and n.startswith("libcudnn"):  # the sub-libraries it loads at run time, beside it
                    cudnn.add(os.path.realpath(w))
                    m += [f"{sub} (beside {w})" for sub in CUDNN_SUBLIBS
                          if not os.path.isfile(os.path.join(os.path.dirname(w), sub))]
            if m:
                missing[b] = m
        # Which cuDNN the binaries load on this machine.
        self.summary["cudnn"] = sorted(cudnn)
        self.stage("libraries", {"missing": missing, "cudnn": sorted(cudnn), "ld_library_path": env["LD_LIBRARY_PATH"]},
                   not missing)
        return not missing

    def unpack_stage(self):
        """Unpacks BUILD/ARCHIVE into a temporary folder, which the later stages run from (Note
        [packed carry]); its time counts in the budget. A BUILD without the archive (a build
        folder, or a folder packed before the archive) is used as it is. False when unpacking
        failed: no other stage can run then."""
        archive = os.path.join(self.build, ARCHIVE)
        if not os.path.isfile(archive):
            return True
        t = time.monotonic()
        try:
            self.unpacked = unpack_carry(self.build)
            ok, verdict = True, "passed"
        except Exception as e:
            ok, verdict = False, f"failed (the archive does not unpack: {type(e).__name__}: {e})"[:400]
        result = {"archive": archive, "archive_bytes": os.path.getsize(archive), "seconds": round(time.monotonic() - t, 1),
                  "verdict": verdict}
        if ok:
            self.build = self.summary["build"] = self.unpacked
            result.update(into=self.unpacked, unpacked_bytes=dir_bytes(self.unpacked))
            self.read_manifest(self.unpacked)
        self.stage("unpack", result, ok)
        return ok

    def tests_stage(self, rel="tests/test_cuda", cap=None):
        label = os.path.basename(rel)
        r = self.gtest(label, self.exe(rel), chorus_env(self.build), cap=time_cap(rel, 60) if cap is None else cap,
                       keep=time_keep(rel))
        r["binary"] = rel
        # On a GPU machine a skipped test is a test that did not run: a failure (gtest_verdict).
        verdict, ok = gtest_verdict(r, self.gpu, self.dry)
        r.update(verdict=verdict, counts=counts(r))
        self.stage("tests" if label == "test_cuda" else label, r, ok)
        return r

    def rerun_stage(self, r):
        todo = r["failed"] + [c.replace(" (timed out)", "") for c in r["crashed"]] + (r["skipped"] if self.gpu else [])
        rel = r.get("binary", "tests/test_cuda")
        keep = time_keep(rel)  # the reruns take only time above what the test stage keeps
        results = {}
        start = time.monotonic()
        for name in todo:
            limit = min(RERUN_EACH_S, RERUN_BINARY_S - (time.monotonic() - start), self.left() - keep)
            if limit < RERUN_MIN_S:
                results[name] = "not rerun (time)"
                continue
            jpath = os.path.join(self.logs, f"rerun-{os.path.basename(rel)}-" + re.sub(r"[^A-Za-z0-9._-]", "_", name) +
                                 ".json")
            rc, to, secs, lpath = self.run("rerun", [self.exe(rel), f"--gtest_filter={name}",
                                                     f"--gtest_output=json:{jpath}"],
                                           limit, env=chorus_env(self.build, {"CHORUS_DEBUG_SYNC": "1"}),
                                           log_name="rerun-debug-sync.log")
            p, f, sk, _, crash = self.parse_gtest(jpath, lpath)
            if to:
                results[name] = "timeout"
            elif p and not f and not sk and rc == 0:
                results[name] = "passed"
            else:
                results[name] = "skipped" if sk else (f"crashed (rc {rc})" if crash or not f else f"failed (rc {rc})")
        if todo:
            label = os.path.basename(rel)
            good = sum(v == "passed" for v in results.values())
            self.stage("rerun_alone_debug_sync" + ("" if label == "test_cuda" else "_" + label),
                       {"results": results, "verdict": f"{good} of {len(results)} passed alone (a diagnosis: the "
                                                       f"stage before keeps its verdict)"},
                       good == len(results))

    def tutorial_stage(self):
        rc, to, secs, path = self.run("tutorial", [self.exe("examples/data_parallel_tutorial_cuda"), "--gpus"],
                                      self.limit("tutorial"), env=chorus_env(self.build))
        with open(path, errors="replace") as f:
            text = f.read()
        verdict, ok = tutorial_verdict(rc, to, text)
        self.stage("tutorial", {"rc": rc, "timed_out": to, "seconds": round(secs, 1),
                                "batches": len(re.findall(r"^Outside: input size", text, re.M)),
                                "head": text.splitlines()[1:4], "verdict": verdict}, ok)

    def train_lm_stage(self):
        out = os.path.join(self.logs, "train_lm_out")
        rc, to, secs, path = self.run("train_lm", [self.exe("examples/train_lm_cuda")] + TRAIN_LM_ARGS + ["--out", out],
                                      self.limit("train_lm"), env=chorus_env(self.build))
        shutil.rmtree(out, ignore_errors=True)  # its checkpoints: not worth carrying back
        with open(path, errors="replace") as f:
            text = f.read()
        verdict, ok = train_lm_verdict(rc, to, text)
        self.stage("train_lm", {"rc": rc, "timed_out": to, "seconds": round(secs, 1),
                                "losses": VAL_LOSS.findall(text), "verdict": verdict}, ok)

    def distributed_stage(self):
        """DDP over NCCL on one GPU: scripts/gpu-check-distributed.sh (torchrun's environment, and
        mpirun / torchrun where the machine has them), with the chorus binaries' environment. Each
        test run is judged from its GoogleTest report as the test stages are (gtest_verdict),
        each program by its exit status; a launcher the machine lacks is reported, not failed."""
        if not all(os.path.isfile(self.exe(b)) for b in DIST_BINARIES):
            self.stage("distributed", {"verdict": "did not start (not built: no MPI where the build ran)"}, False)
            return
        dist_out = os.path.join(self.logs, "distributed")
        # Keeps the benchmarks' and memcheck's floors (Note [time budget]); a dry run has no plan.
        limit = self.limit("distributed") if not self.dry else self.timeout(60)
        # The script's own limits stay inside this one (Note: a stage past its limit is killed
        # with its whole session, gpu-check-distributed.sh's children included).
        extra = {"CHORUS_DIST_TIMEOUT_S": "60", "CHORUS_DIST_CHECK_TIMEOUT_S": "40",
                 "CHORUS_DIST_BUDGET_S": str(int(max(5, limit - 10)))}
        if self.dry:
            extra["CHORUS_DIST_CHECK_EPOCHS"] = "1"
        rc, to, secs, _ = self.run("distributed", ["bash", os.path.join(HERE, "gpu-check-distributed.sh"), dist_out,
                                                   self.build], limit, env=chorus_env(self.build, extra))
        result = {"rc": rc, "timed_out": to, "seconds": round(secs, 1), "runs": {}}
        try:
            with open(os.path.join(dist_out, "distributed.json")) as f:
                runs = json.load(f)
        except Exception as e:
            runs = {}
            result["error"] = f"distributed.json unreadable: {e}"
        ok = bool(runs) and not to
        total = {"passed": 0, "failed": [], "skipped": [], "crashed": [], "timed_out": to}
        for name, run in sorted(runs.items()):
            if "not_run" in run:  # a launcher the machine lacks is reported; a run cut for time fails
                result["runs"][name] = {"verdict": "not run (" + run["not_run"] + ")"}
                ok = ok and run["not_run"].startswith("no ")
                continue
            if name.endswith("_tests"):
                jpath = os.path.join(dist_out, name + ".json")
                p, f, sk, _, crash = self.parse_gtest(jpath, os.path.join(dist_out, name + ".log"))
                r = {"passed": len(p), "failed": f, "skipped": sk, "crashed": [crash] if crash else [],
                     "rc": run.get("rc", -1), "timed_out": run.get("timed_out", False), "report": os.path.isfile(jpath)}
                verdict, good = gtest_verdict(r, self.gpu, self.dry)
                for k in ("failed", "skipped", "crashed"):
                    total[k] += [f"{name}: {t}" for t in r[k]]
                total["passed"] += r["passed"]
                result["runs"][name] = {"verdict": verdict, "counts": counts(r)}
            else:
                good = run.get("rc") == 0 and not run.get("timed_out")
                result["runs"][name] = {"verdict": program_verdict(run.get("rc", -1), run.get("timed_out"), good, ""),
                                        "rc": run.get("rc")}
            ok = ok and good
        if not any(n.endswith("_tests") and "not_run" not in r for n, r in runs.items()):
            ok = False  # at least the torchrun-environment tests must have run
        result["counts"] = counts(total)
        bad = [f"{n}: {r['verdict']}" for n, r in sorted(result["runs"].items())
               if not r["verdict"].startswith(("passed", "not run (no "))]
        if ok:
            result["verdict"] = "passed"
        elif to:
            result["verdict"] = "timed out" + (" (" + "; ".join(bad) + ")" if bad else "")
        elif not runs:
            result["verdict"] = "did not start (no distributed.json)"
        else:
            result["verdict"] = "failed (" + ("; ".join(bad) or "no test run ran") + ")"
        self.stage("distributed", result, ok)

    def bench_stage(self):
        """The GPU benchmarks in one interleaved run: pytorch_gpu_bench.py --chorus starts
        chorus_gpu_bench --serve and alternates rounds with it (A B A B; both JSON files carry one
        run_id), so compare_benchmarks.py pairs each ratio round by round (Note [paired rounds] in
        benchmarks/bench_util.hpp). Passes when the driver exited 0 in time, neither side recorded
        an error and at least one row was compared; every row's median ratio with its min-max is
        reported, and rows that came out unpaired or are missing are named."""
        cj, pj, cmp_json = (os.path.join(self.logs, n) for n in ("chorus_gpu.json", "pytorch_gpu.json", "compare.json"))
        cenv = chorus_env(self.build)
        # Memcheck's floor and compare_benchmarks.py's time stay (Note [time budget]).
        limit = self.timeout(time_cap("benchmarks"), reserve=time_keep("benchmarks") + COMPARE_S)
        # PyTorch runs with python3's own environment (its own CUDA libraries); only
        # chorus_gpu_bench gets the chorus binaries' LD_LIBRARY_PATH (--chorus-env).
        rc, to, secs, _ = self.run("gpu_bench",
                                   [sys.executable, BENCH_DRIVER, "--chorus", self.exe("benchmarks/chorus_gpu_bench"),
                                    "--chorus-env", "LD_LIBRARY_PATH=" + cenv["LD_LIBRARY_PATH"],
                                    "--json", pj, "--chorus-json", cj],
                                   limit, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        docs, notes = {}, {}
        for side, path in (("chorus", cj), ("pytorch", pj)):
            try:
                with open(path) as f:
                    d = json.load(f)
                docs[side] = d if isinstance(d, dict) else {"records": d}
            except FileNotFoundError:
                notes[side + "_json"] = "not written"
            except Exception as e:
                notes[side + "_json"] = f"unreadable: {e}"
        errors = {side: docs.get(side, {}).get("errors") or [] for side in ("chorus", "pytorch")}
        # A timeout leaves what the driver wrote after each workload: that is compared too.
        rows = None
        if len(docs) == 2:
            self.run("compare", [sys.executable, COMPARE, cj, pj, cmp_json],
                     self.timeout(COMPARE_S, reserve=time_keep("benchmarks")), env=dict(os.environ))
            try:
                with open(cmp_json) as f:
                    rows = json.load(f)
            except Exception as e:
                notes["compare"] = f"unreadable: {e}"
        rows = rows if isinstance(rows, list) else []
        name = lambda r: f"{r['workload']} {r['chorus_config']} vs {r['peer']}"
        unpaired = [name(r) for r in rows if not r.get("paired")]
        have = {name(r) for r in rows}
        missing = [n for n in bench_row_names() if n not in have]
        ok = rc == 0 and not to and bool(rows) and not errors["chorus"] and not errors["pytorch"]
        shown = f"{len(rows)} row(s) compared, {len(rows) - len(unpaired)} paired" + (
            f", {len(unpaired)} unpaired" if unpaired else "") + (f", {len(missing)} missing" if missing else "")
        if to:
            verdict = f"timed out ({shown})"  # what was written before the cut
        elif ok:
            verdict = f"passed ({shown})"
        elif not docs:
            verdict = (program_verdict(rc, to, False, "") if rc == 127 else
                       f"did not start (exit status {rc}, neither JSON written: see gpu_bench.log)")
        else:
            said = [f"{side} {len(e)} error(s): " + "; ".join(error_text(x) for x in e[:3])
                    for side, e in errors.items() if e]
            verdict = f"failed (exit status {rc}, {'; '.join(said + [shown])})"
        result = {"verdict": verdict, "table": [ratio_line(r) for r in rows], "unpaired": unpaired,
                  "missing": missing, "rc": rc, "timed_out": to, "seconds": round(secs, 1), "limit_s": round(limit),
                  "chorus_errors": errors["chorus"], "pytorch_errors": errors["pytorch"],
                  "run_id": {side: d.get("run_id") for side, d in docs.items()}}
        result.update(notes)
        result["ratios"] = rows
        self.stage("benchmarks", result, ok)

    def memcheck_stage(self, plan=None):
        """compute-sanitizer memcheck of MEMCHECK_PLAN within the time left, the caching allocator
        off. Each binary's verdict: its gtest verdict, unless memcheck found errors ("errors
        found") or did not print its ERROR SUMMARY; a cut by the time limit is "timed out", with
        what passed before it (Note: a timeout is not reported as an error found)."""
        san = find_sanitizer()
        if not san:
            self.stage("memcheck", {"verdict": "did not start (compute-sanitizer not found next to nvcc, on PATH "
                                               "or in /usr/local/cuda/bin)"}, not self.gpu)
            return
        env = chorus_env(self.build, {"CHORUS_CUDA_CACHING_ALLOCATOR": "0"})
        result = {"sanitizer": san, "runs": {}}
        total = {"passed": 0, "failed": [], "skipped": [], "crashed": [], "timed_out": False}
        ok = True
        plan = plan or MEMCHECK_PLAN
        for k, (rel, gtest_filter) in enumerate(plan):
            label = "memcheck-" + os.path.basename(rel)
            # An even share of what is left for each binary still to come.
            cap = max(30, (self.left() - 10) / (len(plan) - k))
            # No --leak-check: cuBLAS workspaces, the device-assert guard and pooled events live for
            # the process by design (as PyTorch's do), and would be reported as leaks.
            r = self.gtest(label, self.exe(rel), env, cap=cap, gtest_filter=gtest_filter,
                           prefix=[san, "--tool", "memcheck", "--error-exitcode", "86"])
            text = ""
            for f in sorted(os.listdir(self.logs)):
                if f.startswith(label + "-") and f.endswith(".log"):
                    with open(os.path.join(self.logs, f), errors="replace") as fh:
                        text += fh.read()
            errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
            if re.search(r"device not supported", text, re.I):
                # Not a pass: no memory check happened (sandboxed machines refuse compute-sanitizer).
                result["runs"][rel] = {"verdict": "did not run: compute-sanitizer says the device is not "
                                                  "supported (e.g. under gVisor)"}
                ok = False
                continue
            verdict, good = gtest_verdict(r, self.gpu, self.dry)
            if sum(errors):
                verdict, good = f"errors found ({sum(errors)} memcheck error(s))", False
            elif r["timed_out"]:
                verdict = f"timed out ({r['passed']} test(s) passed under memcheck before the cut, no error in them)"
            elif good and len(errors) < r["runs"]:
                verdict, good = "failed (compute-sanitizer printed no ERROR SUMMARY)", False
            for key in ("failed", "skipped", "crashed"):
                total[key] += [f"{os.path.basename(rel)}: {t}" for t in r[key]]
            total["passed"] += r["passed"]
            total["timed_out"] = total["timed_out"] or r["timed_out"]
            result["runs"][rel] = {"verdict": verdict, "filter": gtest_filter, "counts": counts(r),
                                   "error_summaries": errors, "rc": r["rc"]}
            ok = ok and good
        result["counts"] = counts(total)
        bad = [f"{os.path.basename(n)}: {v['verdict']}" for n, v in result["runs"].items()
               if not v["verdict"].startswith("passed")]
        if ok:
            result["verdict"] = "passed"
        elif all("did not run" in b for b in bad):
            result["verdict"] = ("did not run (compute-sanitizer says the device is not supported: no memory "
                                 "check happened; " + "; ".join(bad) + ")")
        elif all("timed out" in b for b in bad):
            result["verdict"] = "timed out (" + "; ".join(bad) + ")"
        else:
            result["verdict"] = "failed (" + "; ".join(bad) + ")"
        self.stage("memcheck", result, ok)


def dry_run(out, build):
    carry = os.path.join(REPO, CARRY)
    staging = tempfile.mkdtemp(prefix="gpu-carry-staging-")
    try:
        log(f"== packing {build} into {carry}/{ARCHIVE}")
        manifest = pack(build, staging)
        for name, size in sorted(manifest["binaries"].items()):
            log(f"   carried {name:40s} {size / 2**20:6.1f} MiB")
        for name, size in sorted(manifest["libs"].items()):
            log(f"   carried lib/{name:36s} {size / 2**20:6.1f} MiB")
        for name, size in sorted(manifest["fallback_libs"].items()):
            log(f"   carried lib-fallback/{name:27s} {size / 2**20:6.1f} MiB (used only where the machine's own is too old)")
        t = time.monotonic()
        packed = write_archive(staging, carry)
        log(f"== {ARCHIVE}: {manifest['unpacked_bytes'] / 2**20:.1f} MiB packed into {packed / 2**20:.1f} MiB "
            f"in {time.monotonic() - t:.0f} s")
        expected = tree_listing(staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    problems, total = size_problems(carry)
    log(f"== working tree + {CARRY}: {total / 2**20:.1f} MiB of {TREE_LIMIT >> 20} MiB "
        f"(must stay under {(TREE_LIMIT - TREE_MARGIN) >> 20} MiB; {(TREE_LIMIT - total) / 2**20:.1f} MiB to spare); "
        f"{len(manifest['libs'])} libraries, {len(BINARIES)} binaries")
    san = find_sanitizer()
    log(f"== compute-sanitizer here: {san or 'not found (the GPU machine has it next to nvcc)'}")
    # The stages' own machinery, run here on the carried binaries as the GPU run runs them: the
    # archive unpacked first into a temporary folder, test_cuda starts with the carried
    # environment, its tests skip (no GPU), and $OUT holds what the tool returns.
    os.makedirs(out, exist_ok=True)
    problems += plan_problems()
    run = Run(out, carry, gpu=has_gpu(), dry=True, part="dry-run")
    try:
        if not run.unpack_stage() or run.build == carry:
            problems.append("unpack: " + run.summary["stages"].get("unpack", {}).get("verdict", "no archive"))
        else:
            log(f"== unpacked into {run.build} in {run.summary['stages']['unpack']['seconds']} s")
            got = tree_listing(run.build)
            if got != expected:
                diff = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
                problems.append(f"unpack: the unpacked folder differs from the one packed: {diff[:10]}")
            problems += verify(build, run.build)
            if not run.ldd_stage():
                problems.append("libraries: " + json.dumps(run.summary["stages"]["libraries"]["missing"]))
            for rel in TEST_BINARIES:
                r = run.tests_stage(rel)
                if not r["ok"]:
                    problems.append(f"{rel}: {r['verdict']}")
            problems += memcheck_plan_problems(run.build, chorus_env(run.build))
            problems += serve_problems(run.build, chorus_env(run.build))
            # The distributed stage's script with the carried binaries (the tests skip, train_mlp_cuda
            # runs on the CPU): its environment, launchers and report files work before a GPU is lent.
            run.distributed_stage()
            if not run.summary["stages"]["distributed"]["ok"]:
                problems.append("distributed: " + run.summary["stages"]["distributed"]["verdict"])
        run.summary["dry_run_problems"] = problems
        run.summary["carry_bytes"] = {"archive": packed, "unpacked": manifest["unpacked_bytes"], "tree_and_carry": total}
        run.save(final=True)
    finally:
        run.cleanup()
    out_problems, files = check_out_dir(out)
    problems += out_problems
    log(f"== $OUT would return: {', '.join(sorted(files))}")
    for p in problems:
        log(f"PROBLEM: {p}")
    log("== dry run: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
    return 0 if not problems else 1


def plan_problems():
    """What is wrong with PLANS (Note [time budget]): every test binary planned in the correctness
    part, every stage gpu_run runs planned once, each part's floors inside BUDGET_S, caps not
    below floors, and BUDGET_S with the machine's start inside the device tool's per-call limit."""
    problems = []
    stages = [n for plan in PLANS.values() for n, _, _ in plan]
    want = TEST_BINARIES + ["tutorial", "train_lm", "distributed", "benchmarks", "memcheck"]
    if sorted(stages) != sorted(want):
        problems.append(f"plan: the planned stages {stages} are not the ones gpu_run runs {want}")
    if [n for n, _, _ in PLANS["correctness"] if n.startswith("tests/")] != TEST_BINARIES:
        problems.append("plan: the correctness part must run every test binary, in TEST_BINARIES' order")
    for part, plan in PLANS.items():
        floors = sum(f for _, _, f in plan)
        if floors > BUDGET_S:
            problems.append(f"plan: {part}'s floors add up to {floors} s, over its {BUDGET_S} s")
        problems += [f"plan: {part}: {n}'s cap {c} s is below its floor {f} s" for n, c, f in plan
                     if c is not None and c < f]
    if BUDGET_S + 60 > 600:
        problems.append(f"plan: a part's {BUDGET_S} s and the start do not fit the tool's 600 s per call")
    return problems


def gpu_run(out, build, part):
    """One part of the check (Note [time budget]): "correctness" or "speed"."""
    os.makedirs(out, exist_ok=True)
    gpu = has_gpu()
    run = Run(out, build, gpu=gpu, dry=False, part=part)  # the budget's clock starts here, before the unpack
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except Exception as e:
        smi = f"nvidia-smi: {e}"
    with open(os.path.join(run.logs, "nvidia-smi.txt"), "w") as f:
        f.write(smi)
    run.summary["nvidia_smi"] = [l for l in smi.splitlines() if "H200" in l or "H100" in l or "Driver" in l][:4]
    if not gpu:
        run.stage("gpu", {"error": "no GPU visible (nvidia-smi -L)"}, False)
    try:
        if run.unpack_stage() and run.ldd_stage():
            if part == "correctness":
                for rel in TEST_BINARIES:  # in the plan's order (Note [time budget])
                    run.rerun_stage(run.tests_stage(rel))
                run.tutorial_stage()
                run.train_lm_stage()
                run.distributed_stage()
            else:
                run.bench_stage()
                run.memcheck_stage()  # last: the slowest, and a timeout there still leaves the rest
        run.save(final=True)
    finally:
        run.cleanup()
    log(json.dumps(run.summary, indent=1)[:9000])
    # Last, so that the device tool's output tail holds them however long the summary was.
    for name, verdict in run.summary.get("verdicts", {}).items():
        log(f"verdict {name}: {verdict}")
    for line in run.summary["stages"].get("benchmarks", {}).get("table", []):
        log(f"ratio {line}")
    return 0 if not run.failed else 1


USAGE = "usage: gpu-check.sh correctness|speed OUTDIR [BUILD]   |   gpu-check.sh --dry-run OUTDIR BUILD"


def main(argv):
    if len(argv) >= 1 and argv[0] == "--dry-run":
        if len(argv) != 3:
            raise SystemExit(USAGE)
        return dry_run(os.path.abspath(argv[1]), os.path.abspath(argv[2]))
    if len(argv) not in (2, 3) or argv[0] not in PARTS:
        raise SystemExit(USAGE)
    build = argv[2] if len(argv) > 2 else (os.path.join(REPO, CARRY) if os.path.isdir(os.path.join(REPO, CARRY))
                                           else os.path.join(REPO, "build"))
    return gpu_run(os.path.abspath(argv[1]), os.path.abspath(build), argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
