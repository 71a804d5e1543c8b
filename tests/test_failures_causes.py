"""A failed round leads with its root cause: the rank that was killed and by what, or the
exception a rank raised, before the ranks and nodes that fell with it.

The launcher texts are torchrun's and DeepSpeed's own output formats; the last test kills
a rank of a real run with SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from run_benchmarks.planning.registry import ROOT
from run_benchmarks.running import causes

TORCHRUN = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
/work/main/cases/llama3/megatron/train.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_12:07:46
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 30765)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 30765
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_12:07:46
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 30766)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 30766
=======================================================
"""


def test_the_launchers_root_cause_is_read():
    assert causes.launcher_root_cause(TORCHRUN) == (3, "killed by SIGKILL")  # not the SIGTERM the launcher sent the others
    raised = TORCHRUN.replace("exitcode  : -9 (pid: 30766)  (SIGKILL)", "exitcode  : 1 (pid: 30766)")
    assert causes.launcher_root_cause(raised) == (3, "exit status 1")
    ds = (
        "[2026-11-26 12:00:01,000] [INFO] [launch.py:335:sigkill_handler] Killing subprocess 123\n"
        "[2026-11-26 12:00:01,000] [ERROR] [launch.py:341:sigkill_handler] ['python', 'train.py'] exits with return code = -9\n"
    )
    assert causes.launcher_root_cause(ds) == (None, "killed by SIGKILL")
    assert causes.launcher_root_cause("no summary here") is None


def test_a_logs_cause_is_its_last_exception_line_or_an_address_in_use():
    log = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n[rank1]: ValueError: first\n'
        "Traceback (most recent call last):\n[rank1]: IndexError: index out of range in self\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert causes.log_cause(log) == "IndexError: index out of range in self"
    assert (
        causes.log_cause("[W socket.cpp] The server socket has failed to listen on [::]:29500 (errno: 98 - Address already in use).")
        == "[W socket.cpp] The server socket has failed to listen on [::]:29500 (errno: 98 - Address already in use)."
    )
    assert causes.log_cause("all fine") is None


def test_a_kill_near_the_hosts_memory_says_so():
    assert (
        causes.memory_hint({"host_mem_peak_gib": 125.7, "host_mem_total_gib": 125.8})
        == "; likely out of host memory (peak 125.7 of 125.8 GiB)"
    )
    assert causes.memory_hint({"host_mem_peak_gib": 20.0, "host_mem_total_gib": 125.8}) == ""
    assert causes.memory_hint(None) == ""


@pytest.mark.framework("megatron")
def rank1_a_few_steps_in(tmp_path, *extra: str) -> tuple[subprocess.Popen[str], psutil.Process]:
    """A two-rank llama3_tiny run of endless steps logging into ``tmp_path``, and its rank 1
    once rank 0 has reported three steps."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run_benchmarks" / "start_task.py"),
            "--vendor",
            "cpu",
            "--case_name",
            "llama3_tiny:megatron:cpu:1:2",
            "--log-dir",
            str(tmp_path),
            "--set",
            "train.steps=100000",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = None
    end = time.monotonic() + 240
    while victim is None and time.monotonic() < end and proc.poll() is None:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "train.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1":
                    victim = p
            except psutil.Error:
                continue
        if victim is None:
            time.sleep(0.5)
    assert victim is not None, "rank 1 never started"
    while time.monotonic() < end and proc.poll() is None:
        logs = [f.read_text(errors="replace") for f in tmp_path.glob("*/round1/node0/ranks/*/attempt_0/0/stdout.log")]
        if any(text.count('"train_step"') >= 3 for text in logs):
            break
        time.sleep(0.2)
    return proc, victim


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
def test_a_rank_killed_mid_run_leads_the_rounds_error(megatron_python, tmp_path, sig):
    """SIGKILL (the kernel's out-of-memory killer) leaves no trace but the signal; a fatal
    signal Python can catch (SIGSEGV here, as a crash in a kernel or extension would raise)
    has the rank write where it was, and the line names it."""
    proc, victim = rank1_a_few_steps_in(tmp_path, "--round-timeout", "300")
    os.kill(victim.pid, sig)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, out + err
    (run_dir,) = tmp_path.iterdir()
    res = json.loads((run_dir / "results.json").read_text())
    (rnd,) = res["rounds"]
    first = rnd["error"].splitlines()[0]
    if sig == signal.SIGKILL:
        assert rnd["status"] == "failed" and first == "rank 1 on node0 (localhost) killed by SIGKILL", rnd["error"]
    else:  # the main thread, in the case's step or in what it called
        assert rnd["status"] == "failed" and re.fullmatch(
            r"rank 1 on node0 \(localhost\) killed by SIGSEGV in \S+ \((?:\S+:\d+\), called from \S+ \()?(?:cases|training)/\S+:\d+\)",
            first,
        ), rnd["error"]
    assert f"round 1: failed - {first}" in " ".join(err.split())  # the same line in the terminal (its width wraps it)
    assert res["status"] == "failed" and res["error"] == f"round 1 failed: {first}"
    assert first in (run_dir / "results.md").read_text()


#: the end of every trainer script below: its finish, a log that keeps nothing, and the driver
DRIVE = """\
    def finish(self):
        pass


class Log:
    def end(self, *a, **k):
        pass


case.run(lambda phase: Trainer(), Log())
"""

TRAINER = (
    """\
import os, sys, time
sys.path.insert(0, sys.argv[1])
from training import case


def wait_here(seconds):
    time.sleep(seconds)


class Trainer:
    phase, steps, reporting = None, 4, False

    def build(self):
        pass

    def step(self, k):
        wait_here(1.5 if k in (2, 4) else 0.0)
        if k == 4:  # as the harness's kill of a stuck rank: the call never ends
            os._exit(0)

"""
    + DRIVE
)


CRASHER = """\
import ctypes, threading, time


def idle():
    time.sleep(60)


def crash():
    ctypes.string_at(0)  # reads address 0: SIGSEGV in the main thread


threading.Thread(target=idle, daemon=True).start()
time.sleep(0.2)
crash()
"""


def test_where_a_fatal_signal_struck_is_read_from_pythons_own_report(tmp_path):
    """A real crash (SIGSEGV) with PYTHONFAULTHANDLER, as every rank runs: the crashing
    thread's frames are read from its stderr, another thread's are not."""
    script = tmp_path / "crasher.py"
    script.write_text(CRASHER)
    p = subprocess.run(
        [sys.executable, str(script)], env={**os.environ, "PYTHONFAULTHANDLER": "1"}, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == -signal.SIGSEGV, p.stderr
    frames = causes.fatal_signal_frames("earlier output\n" + p.stderr)
    assert [f for _, _, f in frames] == ["string_at", "crash", "<module>"], p.stderr
    assert re.fullmatch(r"string_at \(__init__.py:\d+\)", causes.describe(frames)), frames  # the stdlib, named by its file
    assert causes.fatal_signal_frames("Traceback (most recent call last):\nValueError: x\n") == []


BUSY_TRAINER = (
    """\
import ctypes, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from training import case


def depth(n):
    return 0 if n == 0 else 1 + depth(n - 1)


def work():
    for _ in range(20):
        depth(30)


def hold_the_lock(seconds):
    ctypes.PyDLL(None).sleep(seconds)  # C code that keeps the interpreter lock


class Trainer:
    phase, steps, reporting = None, int(sys.argv[2]), False

    def build(self):
        pass

    def step(self, k):
        if sys.argv[3] == "hold":
            hold_the_lock(3)
            return
        # busy until the watch has written this step's stacks, however loaded the host
        stacks = os.path.join(os.environ["FB_STACKS_DIR"], "rank0.txt")
        size, end = os.path.getsize(stacks), time.monotonic() + 60
        while os.path.getsize(stacks) == size and time.monotonic() < end:  # short threads, one after another
            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            work()
            for t in threads:
                t.join()

"""
    + DRIVE
)


def test_the_stacks_of_a_busy_call_are_dumped_without_harm_to_the_rank(tmp_path):
    """Steps that outlast a 5 ms timeout with the main thread running Python and threads
    starting and ending all the while: every step's stacks are written and the process ends
    well. faulthandler's watchdog, dumping such a process, crashed it within 0.15 s on this
    kind of machine (SIGSEGV, CPython 3.11.7, 2026-11-28): a rank killed by its own watch."""
    script = tmp_path / "busy.py"
    script.write_text(BUSY_TRAINER)
    env = {**os.environ, "FB_STALL_TIMEOUT_S": "0.005", "FB_STACKS_DIR": str(tmp_path / "stacks"), "RANK": "0"}
    p = subprocess.run([sys.executable, str(script), str(ROOT), "100", "busy"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
    text = (tmp_path / "stacks" / "rank0.txt").read_text()
    assert text.count("Timeout (0:00:00.005000)!") == 100 and len(re.findall(r"^Finished after \d+\.\d s: step \d+$", text, re.M)) == 100, (
        text[-3000:]
    )
    assert text.count(" in step\n") == 100 and text.count(" in <module>\n") == 100, text[-3000:]
    assert " in _dump\n" not in text  # the watch's own thread is left out


def test_a_call_holding_the_interpreter_lock_is_dumped_by_faulthandler(tmp_path):
    """A step inside C code that keeps the interpreter lock (3 s) past a 0.5 s timeout: the
    watch's thread cannot run, so faulthandler's fallback writes the stacks 2 s later, with
    the frame that called into C; the step's end is noted after it."""
    script = tmp_path / "hold.py"
    script.write_text(BUSY_TRAINER)
    env = {**os.environ, "FB_STALL_TIMEOUT_S": "0.5", "FB_STACKS_DIR": str(tmp_path / "stacks"), "RANK": "0"}
    subprocess.run([sys.executable, str(script), str(ROOT), "1", "hold"], env=env, check=True, timeout=60)
    text = (tmp_path / "stacks" / "rank0.txt").read_text()
    fallback = text.split("Timeout (0:00:02.500000)!", 1)
    assert len(fallback) == 2, text
    assert re.search(r'^  File "\S+hold\.py", line \d+ in hold_the_lock$', fallback[1], re.M), text
    assert re.search(r"^Finished after 3\.\d s: step 1$", text, re.M), text


START_HOLDER = (
    """\
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from training import case


def wait_for_a_peer(seconds):
    ctypes.PyDLL(None).sleep(seconds)  # as DeepSpeed's shm.cpp waits for a peer's buffer: in C, the lock held


class Trainer:
    phase, steps, reporting = None, 1, False

    def build(self):
        wait_for_a_peer(int(sys.argv[2]))

    def step(self, k):
        pass

"""
    + DRIVE
)


def test_a_start_up_hang_is_dumped_before_the_startup_timeout_not_the_stall_timeout(tmp_path):
    """A build that waits in C code holding the interpreter lock (DeepSpeed's CPU all-reduce
    waiting for a peer's buffer that was removed: the hang of tests/test_llava_case.py under
    two workers) with a stall timeout of 600 s and a startup timeout of 4 s: its stacks are
    written from the startup timeout (2 s before it, by faulthandler since the lock is held),
    so the harness's startup stop names where it waited; the process groups a case opens
    outlast both timeouts (training/runtime.py), so no collective ends the hang first."""
    script = tmp_path / "holder.py"
    script.write_text(START_HOLDER)
    node = tmp_path / "node0"
    env = {**os.environ, "FB_STALL_TIMEOUT_S": "600", "FB_STARTUP_TIMEOUT_S": "4", "FB_STACKS_DIR": str(node / "stacks"), "RANK": "0"}
    proc = subprocess.Popen([sys.executable, str(script), str(ROOT), "120"], env=env)
    stacks = node / "stacks" / "rank0.txt"
    try:  # as the harness's stop of a rank that never trained: killed while it waits
        end = time.monotonic() + 90
        while " in wait_for_a_peer" not in causes.read(stacks) and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    text = causes.read(stacks)
    header = re.search(r"^Timeout \((\d+):(\d+):([\d.]+)\)!$", text, re.M)
    assert header and int(header[1]) * 3600 + int(header[2]) * 60 + float(header[3]) < 10, text  # not the stall's 600 s
    frames = causes.last_dump_main_thread(text)
    assert frames and frames[0][2] == "wait_for_a_peer" and frames[1][2] == "build", text
    from training import runtime

    os.environ.update(FB_STALL_TIMEOUT_S="600", FB_STARTUP_TIMEOUT_S="900")
    try:
        assert runtime.process_group_timeout().total_seconds() == 900 + runtime.PG_MARGIN_S
    finally:
        del os.environ["FB_STALL_TIMEOUT_S"], os.environ["FB_STARTUP_TIMEOUT_S"]
    assert runtime.process_group_timeout() is None  # outside the harness: the framework's own default


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_call_past_the_stall_timeout_writes_the_ranks_stack_and_the_error_names_it(tmp_path):
    """training/case.py's watch, in a real process: steps 2 and 4 outlast the timeout (each
    writes a dump), the others do not; step 2 ends after all (a line says so: slow, not
    stuck), step 4 never does. The error line names the last dump's innermost frame and the
    project frame it came from, a rank without a file as such, and one whose only dump was of
    a call that ended as one that wrote none."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    node = tmp_path / "node1"
    env = {**os.environ, "FB_STALL_TIMEOUT_S": "0.5", "FB_STACKS_DIR": str(node / "stacks"), "RANK": "3"}
    subprocess.run([sys.executable, str(script), str(ROOT)], env=env, check=True, timeout=60)
    text = (node / "stacks" / "rank3.txt").read_text()
    assert text.count("Timeout (0:00:00.500000)!") == 2 and text.count("Finished after 1.") == 1, text
    assert re.search(r"^Finished after 1\.\d s: step 2$", text, re.M), text
    lines = causes.stall_stacks(node, [2, 3], "node1 (h2)")
    line = next(n for n, ln in enumerate(TRAINER.splitlines(), 1) if "time.sleep(seconds)" in ln)
    assert lines[0] == (
        "rank 2 on node1 (h2): no stack written by its timeout (a stopped process, or one that never reached it, writes none)"
    )
    assert re.fullmatch(
        rf"rank 3 on node1 \(h2\): waited in wait_here \(trainer.py:{line}\), called from run \(training/case.py:\d+\)", lines[1]
    ), lines
    # the dump of step 2 alone (cut before step 4's): that call ended, so nothing is stuck
    (node / "stacks" / "rank2.txt").write_text(text[: text.rindex("Timeout (")])
    assert causes.stall_stacks(node, [2], "node1 (h2)")[0].startswith("rank 2 on node1 (h2): no stack written")
    # without the variables nothing is watched: no folder, no file
    env = {k: v for k, v in env.items() if not k.startswith("FB_")}
    subprocess.run([sys.executable, str(script), str(ROOT)], env={**env, "FB_STACKS_DIR": str(tmp_path / "none")}, check=True, timeout=60)
    assert not (tmp_path / "none").exists()


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_rank_stopped_mid_run_is_found_at_the_stall_timeout_with_where_the_ranks_waited(megatron_python, tmp_path):
    """A real two-rank run: rank 1 is stopped (SIGSTOP, as a rank stuck in the kernel would
    be) a few steps in; rank 0 waits for it in a collective. Long before the round deadline
    the round fails as hung, names the step after which nothing came, where rank 0 waited
    and that rank 1 wrote no stack; no process of the run is left."""
    t0 = time.monotonic()
    proc, victim = rank1_a_few_steps_in(tmp_path, "--stall-timeout", "4", "--round-timeout", "600")
    os.kill(victim.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, out + err
    assert time.monotonic() - stopped_at < 120, f"{time.monotonic() - stopped_at:.0f} s after the stop"
    (run_dir,) = tmp_path.iterdir()
    res = json.loads((run_dir / "results.json").read_text())
    (rnd,) = res["rounds"]
    lines = rnd["error"].splitlines()
    assert rnd["status"] == "failed" and re.fullmatch(
        r"node0 \(localhost\): no record from any rank for 4 s after step \d+ \(stall_timeout_s\): the ranks hang; stopped",
        lines[0],
    ), rnd["error"]
    assert re.fullmatch(
        r"rank 0 on node0 \(localhost\): waited in \S+ \(\S+:\d+\), called from \S+ \((?:cases/llama3/megatron|training)/\S+\.py:\d+\)",
        lines[1],
    ), rnd["error"]
    assert lines[2].startswith("rank 1 on node0 (localhost): no stack written by its timeout"), rnd["error"]
    assert f"round 1: failed - {lines[0]}" in " ".join(err.split())  # the terminal's width wraps it
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    print(f"found {time.monotonic() - stopped_at:.0f} s after the stop, {time.monotonic() - t0:.0f} s in all")


@pytest.mark.alone  # times something: tests/parallel.py
def test_a_stack_written_on_resuming_a_stopped_rank_is_no_location(tmp_path):
    """A rank stopped (SIGSTOP) inside a step, past its stall timeout, then resumed (as a
    cancel's SIGCONT does) and killed: the stacks its watch writes on resuming are not where
    it hung, and the line says that no stack was written at the stall timeout."""
    script = tmp_path / "stopped.py"
    script.write_text(TRAINER.replace("wait_here(1.5 if k in (2, 4) else 0.0)", "wait_here(60)"))
    node = tmp_path / "node0"
    env = {**os.environ, "FB_STALL_TIMEOUT_S": "1", "FB_STACKS_DIR": str(node / "stacks"), "RANK": "0"}
    proc = subprocess.Popen([sys.executable, str(script), str(ROOT)], env=env)
    try:
        end = time.monotonic() + 30
        while not (node / "stacks" / "rank0.txt").exists() and time.monotonic() < end:
            time.sleep(0.05)  # the watch is armed
        time.sleep(0.3)  # step 1 has begun
        proc.send_signal(signal.SIGSTOP)
        time.sleep(8)  # past the timeout and faulthandler's fallback, while stopped
        proc.send_signal(signal.SIGCONT)
        time.sleep(2)
    finally:
        proc.kill()
        proc.wait()
    text = (node / "stacks" / "rank0.txt").read_text()
    assert "Written late:" in text, text
    assert causes.stall_stacks(node, [0], "node0 (n2)") == [
        "rank 0 on node0 (n2): no stack written by its timeout (a stopped process, or one that never reached it, writes none)"
    ], text
