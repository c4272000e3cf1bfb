#!/usr/bin/env python3
"""The verdicts of scripts/gpu-check.sh (scripts/gpu_check.py), with fake binaries: no GPU needed.

A GPU may be lent for one 15-minute session, so the check must not read "ok" when nothing ran.
Each fake test binary behaves like a GoogleTest program that went one particular way (exit 127
before any test, SIGSEGV after its JSON report, zero tests, a skipped test, a crash in a test,
a failure, a hang); each case checks the stage's verdict and that the run as a whole fails.
Also: memcheck under a fake compute-sanitizer, the kill of a stage's whole session on timeout
(GNU timeout's own process group included), and gpu-check-distributed.sh's library order and
time budget. Run by CTest (gpu_check_verdicts, label cpu).
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
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

    def make_run(self, gpu=True, dry=False):
        os.makedirs(self.out, exist_ok=True)
        r = gpu_check.Run(self.out, self.build, gpu=gpu, dry=dry)
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
        with open(os.path.join(self.out, "summary.json")) as f:
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


class TestMemcheck(Base):
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


if __name__ == "__main__":
    unittest.main(verbosity=2)
