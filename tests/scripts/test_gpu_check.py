#!/usr/bin/env python3
"""The verdicts of scripts/gpu-check.sh (scripts/gpu_check.py), with fake binaries: no GPU needed.

A GPU may be lent for one 15-minute session, so the check must not read "ok" when nothing ran.
Each fake test binary behaves like a GoogleTest program that went one particular way (exit 127
before any test, SIGSEGV after its JSON report, zero tests, a skipped test, a crash in a test,
a failure, a hang); each case checks the stage's verdict and that the run as a whole fails.
Also: memcheck under a fake compute-sanitizer, the kill of a stage's whole session on timeout
(GNU timeout's own process group included), gpu-check-distributed.sh's library order and time
budget, the benchmark stage with a fake pytorch_gpu_bench.py driving a fake chorus_gpu_bench
--serve, and the stages' shares of each part's 240 s with a fake clock (Note [time budget]). Run by
CTest (gpu_check_verdicts, label cpu).
"""
import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import types
import unittest
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import compare_benchmarks  # noqa: E402
import gpu_check  # noqa: E402

# A GoogleTest look-alike: the mode is baked in when the file is written.
FAKE_GTEST = r'''#!PYTHON
import json, os, signal, sys, time
MODE = "@MODE@"
TESTS = ["Fake.A", "Fake.B"]
out = next((a[len("--gtest_output=json:"):] for a in sys.argv if a.startswith("--gtest_output=json:")), None)
filt = next((a[len("--gtest_filter="):] for a in sys.argv if a.startswith("--gtest_filter=")), "*")
excluded = filt.split("-", 1)[1].split(":") if "-" in filt else []
if "--gtest_list_tests" in sys.argv:
    import fnmatch
    for t in TESTS:
        if any(fnmatch.fnmatchcase(t, p) for p in filt.split("-")[0].split(":")):
            print(t.split(".")[0] + ".\n  " + t.split(".")[1])
    sys.exit(0)
if os.environ.get("FAKE_LD_OUT"):
    with open(os.environ["FAKE_LD_OUT"], "a") as f:
        f.write(os.environ.get("LD_LIBRARY_PATH", "") + "\n")
if MODE == "exit127":
    print("fake: error while loading shared libraries: libcudnn_graph.so.9: cannot open shared object file",
          file=sys.stderr)
    sys.exit(127)
if MODE == "hang":
    print("[ RUN      ] Fake.A", flush=True)
    time.sleep(600)
results = {}
for t in [t for t in TESTS if t not in excluded]:
    print(f"[ RUN      ] {t}", flush=True)
    if MODE == "crash" and t == "Fake.A":
        os.kill(os.getpid(), signal.SIGSEGV)
    res = "FAILED" if MODE == "fail" and t == "Fake.B" else "SKIPPED" if MODE == "skip" and t == "Fake.B" else "OK"
    print({"OK": "[       OK ] ", "FAILED": "[  FAILED  ] ", "SKIPPED": "[  SKIPPED ] "}[res] + t + " (0 ms)", flush=True)
    results[t] = res
if MODE in ("zero", "allskip"):
    results = {t: "SKIPPED" for t in TESTS} if MODE == "allskip" else {}
suites = {}
for name, res in results.items():
    s, c = name.split(".")
    case = {"name": c, "status": "RUN", "result": "SKIPPED" if res == "SKIPPED" else "COMPLETED"}
    if res == "FAILED":
        case["failures"] = [{"failure": "expected 1, got 2"}]
    suites.setdefault(s, []).append(case)
if out:
  with open(out, "w") as f:
    json.dump({"tests": len(results), "testsuites": [{"name": s, "testsuite": cs} for s, cs in suites.items()]}, f)
if MODE == "segv_after_json":
    os.kill(os.getpid(), signal.SIGSEGV)
sys.exit(1 if "FAILED" in results.values() else 0)
'''

# compute-sanitizer look-alike: runs the program, prints its ERROR SUMMARY, passes on its status.
FAKE_SANITIZER = r'''#!PYTHON
import subprocess, sys
args, code = sys.argv[1:], 0
while args and args[0].startswith("--"):
    if args[0] == "--error-exitcode":
        code = int(args[1])
    args = args[2:]
print("========= COMPUTE-SANITIZER", flush=True)
rc = subprocess.call(args)
errors = @ERRORS@
if errors:
    print("========= Invalid __global__ read of size 4 bytes", flush=True)
print(f"========= ERROR SUMMARY: {errors} error{'' if errors == 1 else 's'}", flush=True)
sys.exit(code if errors else rc)
'''


# The rows compare_benchmarks.py looks for: chorus's configurations and the peers', by workload.
CHORUS_CONFIGS, PEER_OFFERS = {}, []
for _w, _cc, _pi, _pc, _ in compare_benchmarks.TARGETS:
    CHORUS_CONFIGS.setdefault(_w, [])
    for _c in [_cc] + ([_pc] if _pi == "chorus" else []):
        if _c not in CHORUS_CONFIGS[_w]:
            CHORUS_CONFIGS[_w].append(_c)
    if _pi != "chorus" and [_pi, _w, _pc] not in PEER_OFFERS:
        PEER_OFFERS.append([_pi, _w, _pc])

# chorus_gpu_bench --serve look-alike (Note [peer protocol]): round k of a configuration takes k ms.
FAKE_CHORUS_SERVE = r"""#!PYTHON
import json, os, sys
MODE = "@MODE@"
CONFIGS = @CONFIGS@
with open(os.environ["FAKE_BENCH_OUT"], "a") as f:
    f.write(json.dumps({"side": "chorus", "argv": sys.argv[1:], "pid": os.getpid(),
                        "ld": os.environ.get("LD_LIBRARY_PATH", "")}) + "\n")
if sys.argv[1:] != ["--serve"]:
    print("fake chorus_gpu_bench: only --serve", file=sys.stderr)
    sys.exit(2)
done = {}
for line in sys.stdin:
    req = json.loads(line)
    w = req["workload"]
    if req["cmd"] == "configs":
        cs = [c for c in CONFIGS.get(w, []) if not (MODE == "no_dp" and c.startswith("DataParallel {"))]
        reply = {"configs": [dict(impl="chorus", workload=w, config=c, devices=1, threads=0) for c in cs]}
    elif req["cmd"] == "round" and MODE == "round_error" and req["config"] == "1 GPU tf32":
        reply = {"error": "CUDA error: an illegal memory access was encountered"}
    elif req["cmd"] == "round":
        k = done[(w, req["config"])] = done.get((w, req["config"]), 0) + 1
        reply = {"samples_ms": [float(k)] * req["reps"]}
    else:
        reply = {"released": w}
    print(json.dumps(reply), flush=True)
"""

# pytorch_gpu_bench.py look-alike: its options, and bench_rounds.drive with PyTorch's rows faked
# (every step 2 ms), chorus_gpu_bench --serve as the peer.
FAKE_BENCH_DRIVER = r"""#!PYTHON
import argparse, json, os, sys, time
sys.path.insert(0, @BENCH_DIR@)
from bench_rounds import PeerProcess, drive
MODE = "@MODE@"
OFFERS = @OFFERS@
ap = argparse.ArgumentParser()
ap.add_argument("--json", required=True)
ap.add_argument("--chorus", required=True)
ap.add_argument("--chorus-env", action="append", default=[])
ap.add_argument("--chorus-json", required=True)
args = ap.parse_args()
with open(os.environ["FAKE_BENCH_OUT"], "a") as f:
    f.write(json.dumps({"side": "pytorch", "pid": os.getpid(), "ld": os.environ.get("LD_LIBRARY_PATH", "")}) + "\n")
if MODE == "no_torch":
    print("ModuleNotFoundError: No module named 'torch'", file=sys.stderr)
    sys.exit(1)
env = dict(os.environ)
env.update(kv.split("=", 1) for kv in args.chorus_env)

def offers(w):
    out = []
    for impl, ww, c in OFFERS:
        def build(c=c):
            if MODE == "local_error" and c.endswith("channels_last"):
                raise RuntimeError("CUDA out of memory")
            if MODE == "hang" and w != "tutorial":
                time.sleep(600)
            return lambda: None
        if ww == w:
            out.append((dict(impl=impl, workload=w, config=c, devices=1, threads=0), build, 1))
    return out

workloads = list(dict.fromkeys(w for _, w, _ in OFFERS))
mine, theirs = drive(workloads, offers, lambda w: 2, 3, peer=PeerProcess([args.chorus, "--serve"], env=env),
                     peer_name="chorus", local_name="pytorch", clock=lambda fn: fn() or 2.0,
                     paths=(args.json, args.chorus_json))
if MODE == "other_run":  # as if the two files came from two runs
    mine["run_id"] = "another run"
    with open(args.json, "w") as f:
        json.dump(mine, f)
sys.exit(0 if MODE in ("exit0", "other_run") else 1 if mine["errors"] or theirs["errors"] else 0)
"""


def write_exe(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.replace("#!PYTHON", "#!" + sys.executable, 1))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def alive(pid):
    """True while `pid` runs (a zombie, waiting for a reaper that may never come, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return False
    return s[s.rfind(")") + 2:].split()[0] != "Z"


class Base(unittest.TestCase):
    MODES = ["pass", "exit127", "segv_after_json", "zero", "skip", "allskip", "fail", "crash", "hang"]

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="gpu-check-verdicts-")
        self.build = os.path.join(self.tmp, "build")
        self.out = os.path.join(self.tmp, "out")
        for m in self.MODES:
            write_exe(os.path.join(self.build, "tests", "fake_" + m), FAKE_GTEST.replace("@MODE@", m))
        self.runs = []

    def tearDown(self):
        for r in self.runs:
            shutil.rmtree(r.logs, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def make_run(self, gpu=True, dry=False, part="correctness"):
        os.makedirs(self.out, exist_ok=True)
        r = gpu_check.Run(self.out, self.build, gpu=gpu, dry=dry, part=part)
        self.runs.append(r)
        return r

    def stage_of(self, mode, gpu=True, dry=False, cap=60):
        run = self.make_run(gpu, dry)
        r = run.tests_stage("tests/fake_" + mode, cap=cap)
        return run, r


class TestStageVerdicts(Base):
    def test_all_passed_is_the_only_pass(self):
        run, r = self.stage_of("pass")
        self.assertTrue(r["ok"], r)
        self.assertEqual(r["verdict"], "passed")
        self.assertEqual(r["counts"]["ran"], 2)
        self.assertFalse(run.failed)
        with open(os.path.join(self.out, "summary-correctness.json")) as f:
            summary = json.load(f)
        self.assertIn("passed (ran 2: 2 passed, 0 failed, 0 skipped)", summary["verdicts"]["fake_pass"])

    def test_exit_127_before_any_test_did_not_start(self):
        run, r = self.stage_of("exit127")
        self.assertFalse(r["ok"])
        self.assertTrue(r["verdict"].startswith("did not start"), r["verdict"])
        self.assertIn("127", r["verdict"])
        self.assertTrue(run.failed)

    def test_sigsegv_after_the_json_report_fails(self):
        run, r = self.stage_of("segv_after_json")
        self.assertEqual(r["passed"], 2)  # the report said all passed ...
        self.assertFalse(r["ok"])  # ... but the process crashed
        self.assertIn("exit status -11", r["verdict"])
        self.assertTrue(run.failed)

    def test_zero_tests_fails(self):
        run, r = self.stage_of("zero")
        self.assertFalse(r["ok"])
        self.assertEqual(r["verdict"], "failed (ran no test)")

    def test_a_skipped_test_fails_on_a_gpu_machine(self):
        run, r = self.stage_of("skip", gpu=True)
        self.assertFalse(r["ok"])
        self.assertIn("skipped on the GPU", r["verdict"])
        self.assertEqual(r["counts"]["skipped"], 1)
        self.assertTrue(run.failed)

    def test_skips_are_fine_in_the_dry_run_only(self):
        _, r = self.stage_of("allskip", gpu=False, dry=True)
        self.assertTrue(r["ok"], r["verdict"])
        _, r = self.stage_of("allskip", gpu=False, dry=False)  # the GPU run on a machine without one
        self.assertFalse(r["ok"])
        _, r = self.stage_of("exit127", gpu=False, dry=True)
        self.assertFalse(r["ok"], "a dry run must not pass a binary that cannot start")

    def test_a_failed_test_fails(self):
        _, r = self.stage_of("fail")
        self.assertFalse(r["ok"])
        self.assertEqual(r["failed"], ["Fake.B"])
        self.assertEqual(r["verdict"], "failed (1 test(s))")

    def test_a_crash_is_named_and_the_rest_still_runs(self):
        _, r = self.stage_of("crash")
        self.assertFalse(r["ok"])
        self.assertEqual(r["crashed"], ["Fake.A"])
        self.assertEqual(r["passed"], 1)  # Fake.B, in the run resumed after the crash
        self.assertTrue(r["verdict"].startswith("crashed"), r["verdict"])

    def test_the_tutorial_passes_on_one_gpu_and_on_several(self):
        batches = "".join(f"Outside: input size [{n}, 5] output_size [{n}, 2]\n" for n in (30, 30, 30, 10))
        one_gpu = batches  # PyTorch's tutorial says "Let's use N GPUs!" only for more than one
        self.assertEqual(gpu_check.tutorial_verdict(0, False, one_gpu), ("passed", True))
        self.assertEqual(gpu_check.tutorial_verdict(0, False, "Let's use 2 GPUs!\n" + batches), ("passed", True))
        verdict, ok = gpu_check.tutorial_verdict(0, False, "Let's use 3 CPU devices!\n" + batches)
        self.assertFalse(ok)
        self.assertIn("ran on CPU devices", verdict)
        verdict, ok = gpu_check.tutorial_verdict(0, False, "")
        self.assertFalse(ok)
        self.assertEqual(verdict, "failed (exit status 0, no batch printed)")
        self.assertFalse(gpu_check.tutorial_verdict(1, False, "error: --gpus: no GPU found\n")[1])

    def test_the_libraries_stage_wants_cudnns_sub_libraries_beside_it(self):
        for b in gpu_check.BINARIES:
            write_exe(os.path.join(self.build, b), FAKE_GTEST.replace("@MODE@", "pass"))
        cudnn_dir = os.path.join(self.tmp, "cudnn")
        os.makedirs(cudnn_dir)
        lib = os.path.join(cudnn_dir, "libcudnn.so.9")
        for name in ["libcudnn.so.9"] + gpu_check.CUDNN_SUBLIBS[:-1]:  # libcudnn_cnn.so.9 missing
            open(os.path.join(cudnn_dir, name), "w").close()
        fake_ldd = lambda binary, env: {"libcudnn.so.9": lib, "libc.so.6": "/lib/libc.so.6"}
        run = self.make_run()
        with mock.patch.object(gpu_check, "ldd", fake_ldd):
            self.assertFalse(run.ldd_stage())
        r = run.summary["stages"]["libraries"]
        self.assertEqual(r["missing"]["tests/test_cuda"], [f"libcudnn_cnn.so.9 (beside {lib})"])
        self.assertEqual(run.summary["cudnn"], [os.path.realpath(lib)])
        open(os.path.join(cudnn_dir, "libcudnn_cnn.so.9"), "w").close()
        with mock.patch.object(gpu_check, "ldd", fake_ldd):
            self.assertTrue(self.make_run().ldd_stage())

    def test_train_lm_passes_when_it_learned_on_the_gpus(self):
        head = "batch 16 x 32 on 1 device(s): cuda:0\nbefore training: val loss 4.6000, perplexity 99.48\n"
        learned = head + "epoch 1/1 [====] 30/30 loss 3.1\nepoch 1: val loss 3.2000, perplexity 24.53\nsample:\nThe \n"
        self.assertEqual(gpu_check.train_lm_verdict(0, False, learned), ("passed", True))
        two = learned.replace("on 1 device(s): cuda:0", "on 2 device(s): cuda:0 cuda:1")
        self.assertEqual(gpu_check.train_lm_verdict(0, False, two), ("passed", True))
        verdict, ok = gpu_check.train_lm_verdict(0, False, learned.replace("val loss 3.2000", "val loss 4.7000"))
        self.assertFalse(ok)
        self.assertEqual(verdict, "failed (exit status 0, the validation loss did not fall (4.6000 -> 4.7000))")
        verdict, ok = gpu_check.train_lm_verdict(0, False, learned.replace("val loss 3.2000", "val loss nan"))
        self.assertFalse(ok)
        verdict, ok = gpu_check.train_lm_verdict(0, False, learned.replace("cuda:0", "cpu:0"))
        self.assertEqual((verdict, ok), ("failed (exit status 0, did not run on the GPUs)", False))
        self.assertEqual(gpu_check.train_lm_verdict(0, True, head)[0], "timed out")
        self.assertFalse(gpu_check.train_lm_verdict(1, False, "error: --gpus: no GPU found\n")[1])


class TestMemcheck(Base):
    def refusing_sanitizer(self):
        """compute-sanitizer on a sandboxed machine: refuses the device, runs nothing."""
        path = os.path.join(self.tmp, "compute-sanitizer-refuses")
        write_exe(path, "#!PYTHON\nimport sys\nprint('========= Error: Device not supported', flush=True)\n"
                        "print('========= ERROR SUMMARY: 0 errors', flush=True)\nsys.exit(1)\n")
        return path

    def test_a_refused_device_is_not_a_pass(self):
        run = self.make_run()
        orig = gpu_check.find_sanitizer
        gpu_check.find_sanitizer = self.refusing_sanitizer
        try:
            run.memcheck_stage(plan=[("tests/fake_pass", "Fake.*")])
        finally:
            gpu_check.find_sanitizer = orig
        m = run.summary["stages"]["memcheck"]
        self.assertFalse(m["ok"], m)
        self.assertTrue(m["verdict"].startswith("did not run"), m["verdict"])
        self.assertTrue(m["runs"]["tests/fake_pass"]["verdict"].startswith("did not run"), m)
        self.assertTrue(run.failed)

    def sanitizer(self, errors):
        path = os.path.join(self.tmp, f"compute-sanitizer-{errors}")
        write_exe(path, FAKE_SANITIZER.replace("@ERRORS@", str(errors)))
        return path

    def memcheck(self, plan, errors=0):
        run = self.make_run()
        orig = gpu_check.find_sanitizer
        gpu_check.find_sanitizer = lambda: self.sanitizer(errors)
        try:
            run.memcheck_stage(plan=plan)
        finally:
            gpu_check.find_sanitizer = orig
        return run, run.summary["stages"]["memcheck"]

    def test_clean(self):
        run, m = self.memcheck([("tests/fake_pass", "Fake.*")])
        self.assertTrue(m["ok"], m)
        self.assertEqual(m["verdict"], "passed")
        self.assertEqual(m["counts"]["passed"], 2)

    def test_a_binary_dying_at_start_is_not_clean(self):
        # compute-sanitizer still prints "ERROR SUMMARY: 0 errors".
        run, m = self.memcheck([("tests/fake_pass", "Fake.*"), ("tests/fake_exit127", "*")])
        self.assertFalse(m["ok"])
        self.assertTrue(m["runs"]["tests/fake_exit127"]["verdict"].startswith("did not start"), m)
        self.assertEqual(m["runs"]["tests/fake_exit127"]["error_summaries"], [0])
        self.assertTrue(run.failed)

    def test_errors_found(self):
        _, m = self.memcheck([("tests/fake_pass", "Fake.*")], errors=3)
        self.assertFalse(m["ok"])
        self.assertIn("errors found (3 memcheck error(s))", m["verdict"])

    def test_the_dry_run_finds_a_pattern_that_names_no_test(self):
        env = dict(os.environ)
        self.assertEqual(gpu_check.memcheck_plan_problems(self.build, env, [("tests/fake_pass", "Fake.*:Fake.B")]), [])
        problems = gpu_check.memcheck_plan_problems(self.build, env, [("tests/fake_pass", "Fake.*:Fake/*")])
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("'Fake/*'", problems[0])

    def test_a_timeout_is_its_own_verdict(self):
        orig = gpu_check.BUDGET_S
        gpu_check.BUDGET_S = 2  # stages get their 5 s minimum
        try:
            t = time.monotonic()
            _, m = self.memcheck([("tests/fake_hang", "*")])
        finally:
            gpu_check.BUDGET_S = orig
        self.assertLess(time.monotonic() - t, 30)
        self.assertFalse(m["ok"])
        self.assertTrue(m["verdict"].startswith("timed out"), m["verdict"])
        self.assertNotIn("error", m["verdict"].replace("no error", ""))


class TestTimeouts(Base):
    def test_a_timed_out_stage_leaves_nothing_running(self):
        # GNU timeout moves itself and its child into a process group of their own: killing the
        # stage's process group missed them (issue 17, item 5). The stage's session catches all.
        pidfile = os.path.join(self.tmp, "child.pid")
        child = os.path.join(self.tmp, "child.py")
        with open(child, "w") as f:
            f.write(f"import os, time\nopen({pidfile!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
        run = self.make_run()
        t = time.monotonic()
        rc, timed_out, _, _ = run.run("hang", ["bash", "-c", f"timeout 200 {sys.executable} {child}; echo done"], 2.0)
        self.assertTrue(timed_out)
        self.assertLess(time.monotonic() - t, 20)
        with open(pidfile) as f:
            pid = int(f.read())
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(alive(pid), "the test process under GNU timeout survived the stage's timeout")

    def test_a_hanging_test_binary_times_out(self):
        orig = gpu_check.BUDGET_S
        gpu_check.BUDGET_S = 2
        try:
            run, r = self.stage_of("hang", cap=1)
        finally:
            gpu_check.BUDGET_S = orig
        self.assertFalse(r["ok"])
        self.assertEqual(r["verdict"], "timed out")
        self.assertTrue(r["counts"]["timed_out"])


class TestDistributedScript(Base):
    """scripts/gpu-check-distributed.sh with fake binaries and no launchers on PATH."""

    def setUp(self):
        super().setUp()
        self.bin = os.path.join(self.tmp, "bin")
        os.makedirs(self.bin)
        for tool in ("bash", "mkdir", "timeout", "env", "tail", "cat", "grep", "sort", "sleep"):
            os.symlink(shutil.which(tool), os.path.join(self.bin, tool))
        self.ld_out = os.path.join(self.tmp, "ld.txt")

    def script(self, test_mode, extra_env, limit=60):
        write_exe(os.path.join(self.build, "tests/distributed/test_distributed_cuda"),
                  FAKE_GTEST.replace("@MODE@", test_mode))
        write_exe(os.path.join(self.build, "examples/train_mlp_cuda"), FAKE_GTEST.replace("@MODE@", "pass"))
        env = {"PATH": self.bin, "FAKE_LD_OUT": self.ld_out, "HOME": self.tmp}
        env.update(extra_env)
        out = os.path.join(self.tmp, "dist")
        t = time.monotonic()
        p = subprocess.run([shutil.which("bash"), os.path.join(REPO, "scripts/gpu-check-distributed.sh"), out,
                            self.build], env=env, capture_output=True, text=True, timeout=limit)
        with open(os.path.join(out, "distributed.json")) as f:
            return p, json.load(f), time.monotonic() - t, out

    def test_carried_libraries_come_first(self):
        os.makedirs(os.path.join(self.build, "lib"))
        p, results, _, out = self.script("pass", {"LD_LIBRARY_PATH": "/carried/lib:/cuda/lib64"})
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(results["torchrun_env_tests"], {"rc": 0, "timed_out": False})
        self.assertEqual(results["mpirun_tests"], {"not_run": "no mpirun"})
        self.assertTrue(os.path.isfile(os.path.join(out, "torchrun_env_tests.json")))
        with open(self.ld_out) as f:
            lines = f.read().split()
        self.assertEqual(len(lines), 2)  # the tests and train_mlp, under torchrun's environment
        for line in lines:
            dirs = line.split(":")
            self.assertEqual(dirs[:3], [os.path.abspath(os.path.join(self.build, "lib")), "/carried/lib",
                                        "/cuda/lib64"], line)
            self.assertIn("/usr/local/cuda/lib64", dirs[3:])  # the system's only behind them

    def test_runs_stay_inside_the_budget(self):
        p, results, secs, _ = self.script("hang", {"CHORUS_DIST_CHECK_TIMEOUT_S": "3", "CHORUS_DIST_BUDGET_S": "8"})
        self.assertLess(secs, 15)
        self.assertNotEqual(p.returncode, 0)
        self.assertTrue(results["torchrun_env_tests"]["timed_out"], results)
        self.assertEqual(results["torchrun_env_train_mlp"], {"not_run": "time"})

    def test_the_stage_judges_the_reports(self):
        # A test binary that skips on the GPU and exits 0: the script's exit status is 0, the
        # stage's verdict is not.
        run = self.make_run(gpu=True)
        os.makedirs(os.path.join(self.build, "examples"), exist_ok=True)
        write_exe(os.path.join(self.build, "tests/distributed/test_distributed_cuda"), FAKE_GTEST.replace("@MODE@", "skip"))
        write_exe(os.path.join(self.build, "examples/train_mlp_cuda"), FAKE_GTEST.replace("@MODE@", "pass"))
        path = os.environ["PATH"]
        os.environ["PATH"] = self.bin  # no mpirun, no torchrun
        try:
            run.distributed_stage()
        finally:
            os.environ["PATH"] = path
        d = run.summary["stages"]["distributed"]
        self.assertFalse(d["ok"], d)
        self.assertIn("skipped on the GPU", d["runs"]["torchrun_env_tests"]["verdict"])
        self.assertEqual(d["runs"]["mpirun_tests"]["verdict"], "not run (no mpirun)")
        self.assertEqual(d["runs"]["torchrun_env_train_mlp"]["verdict"], "passed")
        self.assertTrue(run.failed)


class TestBenchStage(Base):
    """The benchmark stage: one interleaved run (pytorch_gpu_bench.py --chorus) whose rounds
    compare_benchmarks.py pairs; an error recorded by either side fails it."""

    def bench(self, driver="pass", server="pass", budget=None):
        os.makedirs(os.path.join(self.build, "lib"), exist_ok=True)
        write_exe(os.path.join(self.build, "benchmarks/chorus_gpu_bench"),
                  FAKE_CHORUS_SERVE.replace("@MODE@", server).replace("@CONFIGS@", repr(CHORUS_CONFIGS)))
        path = os.path.join(self.tmp, "fake_pytorch_gpu_bench.py")
        write_exe(path, FAKE_BENCH_DRIVER.replace("@MODE@", driver).replace("@OFFERS@", repr(PEER_OFFERS))
                  .replace("@BENCH_DIR@", repr(os.path.join(REPO, "benchmarks"))))
        self.seen = os.path.join(self.tmp, "bench-processes.jsonl")
        run = self.make_run(part="speed")
        env = {"FAKE_BENCH_OUT": self.seen, "LD_LIBRARY_PATH": "/python/own/lib"}
        with mock.patch.object(gpu_check, "BENCH_DRIVER", path), mock.patch.dict(os.environ, env), \
                mock.patch.object(gpu_check, "BUDGET_S", budget or gpu_check.BUDGET_S):
            run.bench_stage()
        with open(os.path.join(self.out, "summary-speed.json")) as f:
            self.assertEqual(json.load(f)["stages"]["benchmarks"]["verdict"], run.summary["stages"]["benchmarks"]["verdict"])
        return run, run.summary["stages"]["benchmarks"]

    def processes(self):
        with open(self.seen) as f:
            return {p["side"]: p for p in map(json.loads, f)}

    def test_one_interleaved_run_gives_paired_rows(self):
        run, b = self.bench()
        self.assertTrue(b["ok"], b)
        self.assertEqual(b["verdict"], "passed (12 row(s) compared, 12 paired)")
        self.assertFalse(run.failed)
        self.assertEqual(b["unpaired"], [])
        self.assertEqual(b["missing"], [])
        self.assertEqual(b["run_id"]["chorus"], b["run_id"]["pytorch"])
        # chorus round k takes k ms, PyTorch's 2 ms: the round ratios 0.5, 1, 1.5
        self.assertIn("tutorial DataParallel 1 GPU vs pytorch-dataparallel DataParallel 1 GPU: "
                      "1.00x [0.50-1.50] paired, target <= 0.25 MISSED", b["table"])
        self.assertIn("mlp-large DataParallel {cuda:0, cuda:0} fp32 vs chorus 1 GPU fp32: 1.00x [1.00-1.00] paired, "
                      "target <= 1.15 met", b["table"])
        self.assertIn("mlp-small 1 GPU vs pytorch-cudagraph 1 GPU: 1.00x [0.50-1.50] paired", b["table"])
        self.assertEqual(b["ratios"][0]["round_ratios"], [0.5, 1.0, 1.5])
        # chorus_gpu_bench served the rounds with the chorus binaries' libraries first; the
        # PyTorch side kept python3's own LD_LIBRARY_PATH.
        p = self.processes()
        self.assertEqual(p["chorus"]["argv"], ["--serve"])
        self.assertEqual(p["chorus"]["ld"].split(":")[0], os.path.join(self.build, "lib"))
        self.assertEqual(p["pytorch"]["ld"], "/python/own/lib")

    def test_an_error_on_either_side_fails(self):
        for driver, server, side, row in (("pass", "round_error", "chorus", "mlp-large 1 GPU tf32 vs pytorch-eager"),
                                          ("local_error", "pass", "pytorch", "resnet20-cifar 1 GPU fp32 vs pytorch-eager "
                                                                             "1 GPU fp32 channels_last")):
            with self.subTest(side=side):
                run, b = self.bench(driver, server)
                self.assertFalse(b["ok"], b)
                self.assertTrue(run.failed)
                self.assertTrue(b["verdict"].startswith(f"failed (exit status 1, {side} 1 error(s): "), b["verdict"])
                self.assertEqual(len(b[side + "_errors"]), 1)
                self.assertTrue(any(m.startswith(row) for m in b["missing"]), b["missing"])
                self.assertIn("missing)", b["verdict"])
                self.assertTrue(b["table"])  # the other rows are still reported

    def test_a_recorded_error_fails_even_with_exit_status_0(self):
        _, b = self.bench("exit0", "round_error")
        self.assertEqual(b["rc"], 0)
        self.assertFalse(b["ok"], b)
        self.assertIn("chorus 1 error(s): mlp-large 1 GPU tf32: peer: CUDA error: an illegal memory access",
                      b["verdict"])

    def test_unpaired_and_missing_rows_are_named(self):
        _, b = self.bench("other_run")
        self.assertEqual(b["verdict"], "passed (12 row(s) compared, 1 paired, 11 unpaired)")
        self.assertIn("mlp-small 1 GPU vs pytorch-eager 1 GPU", b["unpaired"])
        self.assertIn("mlp-small 1 GPU vs pytorch-eager 1 GPU: 1.00x unpaired, target <= 0.25 MISSED", b["table"])
        _, b = self.bench(server="no_dp")
        self.assertEqual(b["verdict"], "passed (11 row(s) compared, 11 paired, 1 missing)")
        self.assertEqual(b["missing"], ["mlp-large DataParallel {cuda:0, cuda:0} fp32 vs chorus 1 GPU fp32"])

    def test_a_driver_that_cannot_start(self):
        run, b = self.bench("no_torch")
        self.assertFalse(b["ok"])
        self.assertEqual(b["verdict"], "did not start (exit status 1, neither JSON written: see gpu_bench.log)")
        self.assertEqual((b["chorus_json"], b["pytorch_json"]), ("not written", "not written"))
        self.assertTrue(run.failed)

    def test_a_timeout_keeps_the_rows_measured_and_ends_both_sides(self):
        t = time.monotonic()
        _, b = self.bench("hang", budget=2)  # the stage gets its 5 s minimum
        self.assertLess(time.monotonic() - t, 30)
        self.assertFalse(b["ok"])
        self.assertTrue(b["timed_out"])
        self.assertEqual(b["verdict"], "timed out (1 row(s) compared, 1 paired, 11 missing)")
        self.assertEqual(len(b["table"]), 1)
        for side, p in self.processes().items():
            self.assertFalse(alive(p["pid"]), f"the {side} side outlived the stage's timeout")


class TestDryRunChecks(Base):
    def test_the_dry_run_finds_a_chorus_gpu_bench_without_serve(self):
        exe = os.path.join(self.build, "benchmarks/chorus_gpu_bench")
        # chorus_gpu_bench as it is: its options first, the GPU after; and as it was before the
        # interleaved benchmarks (no --serve, the GPU first).
        now = ("import sys\nif sys.argv[1:] == ['--serve', '--rounds', '0']:\n"
               "    sys.exit(print('error: --rounds must be at least 1, got 0', file=sys.stderr) or 1)\n"
               "sys.exit(print('error: chorus_gpu_bench needs a GPU', file=sys.stderr) or 1)\n")
        write_exe(exe, "#!PYTHON\n" + now)
        self.assertEqual(gpu_check.serve_problems(self.build, dict(os.environ)), [])
        write_exe(exe, "#!PYTHON\nimport sys\nsys.exit(print('error: chorus_gpu_bench needs a GPU', file=sys.stderr) or 1)\n")
        problems = gpu_check.serve_problems(self.build, dict(os.environ))
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("does not take --serve", problems[0])
        self.assertIn("needs a GPU", problems[0])


def fake_clock():
    """A fake `time` module for gpu_check whose clock moves only when told (clock[0] += s)."""
    clock = [0.0]
    return clock, types.SimpleNamespace(monotonic=lambda: clock[0], sleep=lambda s: None, strftime=time.strftime,
                                        gmtime=time.gmtime)


class TestCarry(Base):
    """Note [packed carry]: one xz archive travels; the run unpacks it first, into the layout the
    stages expect."""

    def packed(self):
        for b in gpu_check.BINARIES:
            write_exe(os.path.join(self.build, b), FAKE_GTEST.replace("@MODE@", "pass"))
        staging, carry = os.path.join(self.tmp, "staging"), os.path.join(self.tmp, "carry")
        manifest = gpu_check.pack(self.build, staging)
        with open(os.path.join(staging, "lib", "libfake.so.1"), "wb") as f:  # a carried library
            f.write(os.urandom(1000) * 50)
        size = gpu_check.write_archive(staging, carry)
        return staging, carry, manifest, size

    def test_the_archive_unpacks_into_the_layout_packed(self):
        staging, carry, manifest, size = self.packed()
        self.assertEqual(sorted(os.listdir(carry)), sorted([gpu_check.ARCHIVE, "MANIFEST.json"]))
        self.assertEqual(sorted(manifest["binaries"]), sorted(gpu_check.BINARIES))
        self.assertIn("tests/test_cuda_ops", manifest["binaries"])
        self.assertLess(size, gpu_check.dir_bytes(staging) / 2)  # compressed
        run = self.make_run(gpu=False, dry=True)
        run.build = carry
        self.assertTrue(run.unpack_stage())
        unpacked = run.build
        self.assertNotEqual(unpacked, carry)
        self.assertFalse(unpacked.startswith(REPO + os.sep), "unpacked inside the tree that travels")
        self.assertEqual(gpu_check.tree_listing(unpacked), gpu_check.tree_listing(staging))
        self.assertTrue(os.access(os.path.join(unpacked, "tests/test_cuda_ops"), os.X_OK))
        u = run.summary["stages"]["unpack"]
        self.assertEqual((u["verdict"], u["into"], u["archive_bytes"]), ("passed", unpacked, size))
        # The binaries run from the unpacked folder, with its lib/ first on LD_LIBRARY_PATH.
        self.assertEqual(gpu_check.chorus_env(unpacked)["LD_LIBRARY_PATH"].split(":")[0], os.path.join(unpacked, "lib"))
        r = run.tests_stage("tests/test_cuda_ops")
        self.assertTrue(r["ok"], r)
        run.cleanup()
        self.assertFalse(os.path.exists(unpacked))

    @unittest.skipUnless(shutil.which("xz"), "no xz tool here")
    def test_without_python_lzma_the_xz_tool_unpacks(self):
        staging, carry, _, _ = self.packed()
        with mock.patch.object(gpu_check, "have_lzma", lambda: False):
            unpacked = gpu_check.unpack_carry(carry)
            try:
                self.assertEqual(gpu_check.tree_listing(unpacked), gpu_check.tree_listing(staging))
            finally:
                shutil.rmtree(unpacked)
            with mock.patch.dict(os.environ, {"PATH": self.tmp}), self.assertRaisesRegex(RuntimeError, "no xz tool"):
                gpu_check.unpack_carry(carry)

    def test_an_archive_that_does_not_unpack_stops_the_run(self):
        _, carry, _, _ = self.packed()
        path = os.path.join(carry, gpu_check.ARCHIVE)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            rc = gpu_check.gpu_run(self.out, carry, "correctness")
        self.assertEqual(rc, 1)
        with open(os.path.join(self.out, "summary-correctness.json")) as f:
            summary = json.load(f)
        self.assertTrue(summary["verdicts"]["unpack"].startswith("failed (the archive does not unpack"), summary)
        self.assertNotIn("tests", summary["verdicts"])  # nothing ran from a half-unpacked folder
        self.assertIn("\nverdict unpack: failed", printed.getvalue())

    def test_the_size_check_counts_the_archive_against_the_limit_and_margin(self):
        _, carry, _, size = self.packed()
        with mock.patch.object(gpu_check, "REPO", REPO):
            problems, total = gpu_check.size_problems(carry)
            self.assertEqual(total, gpu_check.tree_bytes() + size + os.path.getsize(os.path.join(carry, "MANIFEST.json")))
            self.assertFalse([p for p in problems if "MiB" in p or "holds more" in p], problems)
            with mock.patch.object(gpu_check, "TREE_LIMIT", total + gpu_check.TREE_MARGIN - 1):
                problems, _ = gpu_check.size_problems(carry)
            self.assertTrue(any("over the device tool's" in p for p in problems), problems)
            os.makedirs(os.path.join(carry, "tests"))  # an unpacked copy left beside the archive
            problems, _ = gpu_check.size_problems(carry)
            self.assertTrue(any("holds more than the archive" in p for p in problems), problems)


class TestBudget(Base):
    """Note [time budget]: gpu_run's parts on a fake clock, each command taking the time a
    scenario gives it, or its whole limit when that is shorter."""

    # The first command of each planned stage, by the name Run.run gets.
    COMMAND = {"tests/test_cuda": "test_cuda", "tests/test_cuda_layers": "test_cuda_layers",
               "tests/test_cuda_ops": "test_cuda_ops", "tutorial": "tutorial", "train_lm": "train_lm",
               "distributed": "distributed", "benchmarks": "gpu_bench", "memcheck": "memcheck-"}

    def simulate(self, part, need, failing=None, unpack_s=None):
        """gpu_run of `part` with every command taking need(name) s or its limit; `failing`
        {command: n} gives that test binary's report n failures; `unpack_s` packs the build and
        makes its unpack take that long."""
        for b in gpu_check.BINARIES:
            write_exe(os.path.join(self.build, b), FAKE_GTEST.replace("@MODE@", "pass"))
        build = self.build
        clock, fake_time = fake_clock()
        calls = []

        def run(run_self, name, cmd, timeout, env=None, log_name=None):
            path = os.path.join(run_self.logs, log_name or f"{name}.log")
            open(path, "a").close()
            secs = min(need(name), timeout)
            calls.append((name, gpu_check.BUDGET_S - clock[0], timeout, cmd, env))
            clock[0] += secs
            out = next((a.split(":", 1)[1] for a in cmd if a.startswith("--gtest_output=json:")), None)
            n = (failing or {}).get(name)
            if out and need(name) <= timeout:  # its report: n failures, or two tests passed (one alone)
                cases = ([{"name": f"T{i}", "failures": [{"failure": "x"}]} for i in range(n)] if n else
                         [{"name": "A"}] + ([] if name == "rerun" else [{"name": "B"}]))
                with open(out, "w") as f:
                    json.dump({"testsuites": [{"name": "Cuda", "testsuite": cases}]}, f)
            return (0 if need(name) <= timeout else -9), need(name) > timeout, secs, path

        if unpack_s is not None:
            build = os.path.join(self.tmp, "carry")
            staging = os.path.join(self.tmp, "staging")
            gpu_check.pack(self.build, staging)
            gpu_check.write_archive(staging, build)
        real_unpack = gpu_check.unpack_carry

        def timed_unpack(carry):
            clock[0] += unpack_s or 0
            return real_unpack(carry)

        with mock.patch.object(gpu_check, "time", fake_time), mock.patch.object(gpu_check.Run, "run", run), \
                mock.patch.object(gpu_check, "unpack_carry", timed_unpack), \
                mock.patch.object(gpu_check, "has_gpu", lambda: True), \
                mock.patch.object(gpu_check, "find_sanitizer", lambda: "/fake/compute-sanitizer"), \
                contextlib.redirect_stdout(io.StringIO()) as printed:
            self.rc = gpu_check.gpu_run(self.out, build, part)
        self.printed = printed.getvalue()
        with open(os.path.join(self.out, gpu_check.out_files(part)[0])) as f:
            self.summary = json.load(f)
        self.calls = calls
        stages = [n for n, _, _, _, _ in calls]
        if part == "correctness":
            for command in ("test_cuda", "test_cuda_layers", "test_cuda_ops", "tutorial", "train_lm", "distributed"):
                self.assertIn(command, stages)
            self.assertNotIn("gpu_bench", stages)
        else:
            self.assertEqual(stages.count("gpu_bench"), 1, stages)
            self.assertTrue(stages[-1].startswith("memcheck-"), stages)
            self.assertNotIn("test_cuda", stages)
        first = lambda name: next((left, limit) for n, left, limit, _, _ in calls if n.startswith(name))
        return clock[0], first

    def floors(self):
        return {stage: floor for plan in gpu_check.PLANS.values() for stage, _, floor in plan}

    def test_the_plan_covers_every_stage_and_its_floors_fit(self):
        self.assertEqual(gpu_check.plan_problems(), [])
        self.assertEqual(gpu_check.PARTS, ["correctness", "speed"])  # in the order to run them
        self.assertEqual(sorted(rel for rel, _ in gpu_check.MEMCHECK_PLAN), sorted(gpu_check.TEST_BINARIES))
        self.assertLessEqual(gpu_check.BUDGET_S, 240)
        self.assertEqual(gpu_check.time_keep("tests/test_cuda"), gpu_check.BUDGET_S - 70)
        self.assertEqual(gpu_check.time_keep("distributed"), 0)  # the last of its part
        self.assertEqual(gpu_check.time_keep("benchmarks"), self.floors()["memcheck"])
        self.assertEqual(gpu_check.time_keep("memcheck"), 0)
        bad = {"correctness": gpu_check.PLANS["correctness"][:-1], "speed": [("benchmarks", 10, 200),
                                                                             ("memcheck", None, 100)]}
        with mock.patch.object(gpu_check, "PLANS", bad):
            problems = gpu_check.plan_problems()
        self.assertEqual(len(problems), 3, problems)
        self.assertIn("are not the ones gpu_run runs", problems[0])
        self.assertIn("speed's floors add up to 300 s", problems[1])
        self.assertIn("benchmarks's cap 10 s is below its floor 200 s", problems[2])

    def test_the_command_line_names_the_part(self):
        for argv in ([], ["out"], ["everything", "out"], ["correctness"], ["--dry-run", "out"]):
            with self.assertRaisesRegex(SystemExit, "correctness|speed"):
                gpu_check.main(argv)

    def test_every_command_running_to_its_limit_ends_inside_the_budget(self):
        floors = self.floors()
        for part, plan in gpu_check.PLANS.items():
            total, first = self.simulate(part, lambda name: 1e9)
            self.assertLessEqual(total, gpu_check.BUDGET_S, part)
            self.assertEqual(self.rc, 1)
            # Every stage still gets its floor (the benchmarks' driver less compare_benchmarks.py's 10 s).
            for stage, _, _ in plan:
                if stage != "memcheck":
                    want = floors[stage] - (gpu_check.COMPARE_S if stage == "benchmarks" else 0)
                    self.assertEqual(first(self.COMMAND[stage])[1], want, stage)
            if part == "correctness":
                for rel in gpu_check.TEST_BINARIES:
                    verdict = self.summary["verdicts"]["tests" if rel == "tests/test_cuda" else os.path.basename(rel)]
                    self.assertTrue(verdict.startswith("timed out"), verdict)
            else:
                self.assertGreaterEqual(first("memcheck-")[0], floors["memcheck"])

    def test_a_passing_run_gives_each_stage_its_share(self):
        times = {"test_cuda": 40, "test_cuda_layers": 20, "test_cuda_ops": 20, "tutorial": 10, "train_lm": 20,
                 "distributed": 60}
        total, first = self.simulate("correctness", lambda name: times.get(name, 1e9))
        self.assertEqual(first("test_cuda"), (240, 70))  # its floor: the later ones keep 170 s
        self.assertEqual(first("test_cuda_ops"), (180, 45))  # its whole cap
        self.assertEqual(first("train_lm"), (150, 45))
        self.assertEqual(first("distributed"), (130, 90))
        self.assertEqual(self.summary["verdicts"]["test_cuda_ops"], "passed (ran 2: 2 passed, 0 failed, 0 skipped)")
        self.assertIn("\nverdict test_cuda_ops: passed", self.printed)
        self.assertIn("\nverdict train_lm: failed", self.printed)  # the output's tail has every verdict
        self.assertLessEqual(total, gpu_check.BUDGET_S)
        self.assertEqual(self.rc, 1)  # the fake tutorial and train_lm printed nothing
        total, first = self.simulate("speed", lambda name: 60 if name == "gpu_bench" else 1e9)
        self.assertEqual(first("gpu_bench"), (240, 240 - 120 - 10))  # all but memcheck's floor and compare's
        self.assertEqual(first("memcheck-")[0], 240 - 60)  # nothing to compare: the fake driver wrote no JSON
        self.assertLessEqual(total, gpu_check.BUDGET_S)

    def test_slow_failing_tests_and_hanging_reruns_still_end_inside_the_budget(self):
        times = {"test_cuda": 5, "test_cuda_layers": 20, "test_cuda_ops": 20, "tutorial": 10}
        total, first = self.simulate("correctness", lambda name: times.get(name, 1e9),
                                     failing={"test_cuda": 20, "test_cuda_ops": 3})
        reruns = [(left, limit, cmd[0]) for n, left, limit, cmd, _ in self.calls if n == "rerun"]
        self.assertEqual(first("rerun")[1], 45)
        self.assertEqual([l for _, l, c in reruns if c.endswith("/test_cuda")], [45, 15])  # 60 s per binary
        self.assertEqual(self.summary["stages"]["rerun_alone_debug_sync"]["results"]["Cuda.T2"], "not rerun (time)")
        # test_cuda_ops's reruns: 25 s above what its stage keeps (110 s), one rerun of 25 s.
        self.assertEqual([(left, l) for left, l, c in reruns if c.endswith("/test_cuda_ops")], [(135, 25)])
        self.assertEqual(self.summary["stages"]["rerun_alone_debug_sync_test_cuda_ops"]["results"],
                         {"Cuda.T0": "timeout", "Cuda.T1": "not rerun (time)", "Cuda.T2": "not rerun (time)"})
        self.assertTrue(self.summary["verdicts"]["test_cuda_ops"].startswith("failed (3 test(s))"))
        floors = self.floors()
        for stage, _, _ in gpu_check.PLANS["correctness"]:
            self.assertGreaterEqual(first(self.COMMAND[stage])[1], floors[stage], stage)
        self.assertLessEqual(total, gpu_check.BUDGET_S)
        self.assertEqual(self.rc, 1)

    def test_reruns_of_a_later_binary_use_the_time_it_does_not_keep(self):
        times = {"test_cuda": 30, "test_cuda_layers": 10, "test_cuda_ops": 10, "rerun": 5}
        self.simulate("correctness", lambda name: times.get(name, 1e9), failing={"test_cuda_ops": 2})
        reruns = [(limit, cmd, env) for n, _, limit, cmd, env in self.calls if n == "rerun"]
        self.assertEqual(len(reruns), 2)
        for limit, cmd, env in reruns:
            self.assertEqual(limit, 45)
            self.assertTrue(cmd[0].endswith("tests/test_cuda_ops"), cmd)
            self.assertEqual(env["CHORUS_DEBUG_SYNC"], "1")
        self.assertEqual(self.summary["stages"]["rerun_alone_debug_sync_test_cuda_ops"]["results"],
                         {"Cuda.T0": "passed", "Cuda.T1": "passed"})
        self.assertTrue(self.summary["verdicts"]["test_cuda_ops"].startswith("failed (2 test(s))"))
        self.assertEqual(self.rc, 1)  # passing alone is a diagnosis, not a pass

    def test_the_unpack_counts_in_the_budget(self):
        total, first = self.simulate("correctness", lambda name: 1e9, unpack_s=30)
        u = self.summary["stages"]["unpack"]
        self.assertEqual((u["verdict"], u["seconds"]), ("passed", 30))
        self.assertEqual(first("test_cuda"), (240 - 30, 240 - 30 - 170))  # out of the first stage's share
        self.assertEqual(first("test_cuda_layers")[1], 30)  # the later floors are whole
        self.assertLessEqual(total, gpu_check.BUDGET_S)
        # Every command ran from the unpacked folder, which is gone afterwards.
        into = u["into"]
        for name, _, _, cmd, _ in self.calls:
            exe = cmd[0] if not name.startswith(("memcheck", "distributed", "gpu_bench", "compare")) else None
            if exe:
                self.assertTrue(exe.startswith(into + os.sep), (name, cmd))
        self.assertFalse(os.path.exists(into))


class TestCrashResume(Base):
    def test_resuming_after_crashes_stays_inside_the_stage_limit(self):
        # A binary that crashes in a new test every run: the resumed runs share the stage's one
        # limit instead of each getting the whole cap anew.
        clock, fake_time = fake_clock()
        limits = []

        def run(run_self, name, cmd, timeout, env=None, log_name=None):
            path = os.path.join(run_self.logs, log_name)
            limits.append(timeout)
            with open(path, "w") as f:
                f.write(f"[ RUN      ] Fake.T{len(limits)}\n")
            clock[0] += min(40, timeout)
            return (-11 if timeout > 40 else -9), timeout <= 40, min(40, timeout), path

        r = self.make_run()
        with mock.patch.object(gpu_check, "time", fake_time), mock.patch.object(gpu_check.Run, "run", run):
            r.t0 = 0.0
            res = r.gtest("fake", os.path.join(self.build, "tests/fake_crash"), dict(os.environ), cap=100)
        self.assertLessEqual(clock[0], 100)
        self.assertEqual(limits, [100, 60, 20])
        self.assertEqual(res["crashed"], ["Fake.T1", "Fake.T2", "Fake.T3 (timed out)"])
        self.assertTrue(res["timed_out"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
