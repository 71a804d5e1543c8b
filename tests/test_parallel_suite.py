"""tests/parallel.py, the suite on two xdist workers: a pytest session of two small files
(no framework), each test writing when it ran and on which worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TIMED = """
import json, os, time
import pytest

def record(name, t0, path={out!r}):
    with open(path, "a") as f:
        f.write(json.dumps({{"name": name, "worker": os.environ["PYTEST_XDIST_WORKER"], "t0": t0, "t1": time.time()}}) + "\\n")
"""


def test_an_alone_test_runs_with_nothing_beside_it_and_a_file_stays_on_one_worker(tmp_path):
    """Two ``alone`` tests in a row hold the window from the first's start to the second's end;
    they run after the rest of their file, on its worker, though the file has them before two
    of its tests."""
    out = tmp_path / "ran.jsonl"
    (tmp_path / "test_a.py").write_text(
        TIMED.format(out=str(out))
        + """
@pytest.mark.parametrize("k", range(2))
def test_before(k):
    t0 = time.time(); time.sleep(0.4); record(f"a{k}", t0)

@pytest.mark.alone
def test_timed():
    t0 = time.time(); time.sleep(1.5); record("alone", t0)

@pytest.mark.alone
def test_timed_next():
    t0 = time.time(); time.sleep(0.5); record("alone-next", t0)

@pytest.mark.parametrize("k", range(2))
def test_after(k):
    t0 = time.time(); time.sleep(0.4); record(f"a-after{k}", t0)
"""
    )
    (tmp_path / "test_b.py").write_text(
        TIMED.format(out=str(out))
        + """
@pytest.mark.parametrize("k", range(12))
def test_beside(k):
    t0 = time.time(); time.sleep(0.3); record(f"b{k}", t0)
"""
    )
    argv = [sys.executable, "-m", "pytest", "-p", "tests.parallel", "-n", "2", "--dist", "loadgroup", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run([*argv, "--rootdir", str(tmp_path), str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert len(ran) == 18
    workers = {f: {r["worker"] for n, r in ran.items() if n.startswith(f) or (f == "a" and n.startswith("alone"))} for f in ("a", "b")}
    assert len(workers["a"]) == len(workers["b"]) == 1 and workers["a"] != workers["b"], workers  # a file each
    first, second = ran.pop("alone"), ran.pop("alone-next")
    assert first["t1"] <= second["t0"], (first, second)
    assert all(r["t1"] <= first["t0"] for n, r in ran.items() if n.startswith("a")), (first, ran)  # held back to the end
    beside = [r for r in ran.values() if r["worker"] != first["worker"]]
    assert beside and all(r["t1"] <= first["t0"] or r["t0"] >= second["t1"] for r in beside), (first, second, beside)
    # the other worker did run while the file's other tests did: the files were side by side
    a_tests = [r for n, r in ran.items() if n.startswith("a")]
    assert any(b["t0"] < a["t1"] and a["t0"] < b["t1"] for a in a_tests for b in beside), ran


def test_a_launch_removes_only_its_own_shm_buffers():
    """DeepSpeed's CPU all-reduce buffers of a test's launch are removed by its port alone: the
    other worker's launch at another port keeps its buffers, even one made a moment ago that no
    process maps yet (its peer opens it by name next). Removing those by "new and unmapped"
    hung a llava_tiny ZeRO-3 run under two workers (rank 0 in shm.cpp's open loop)."""
    from tests.case_helpers import SHM_BUFFERS, free_port, remove_shm_buffers

    mine, theirs = free_port(), free_port()
    made = [Path(f"{SHM_BUFFERS[:-1]}0_127.0.0.1_{port}_{rank}") for port in (mine, theirs) for rank in (0, 1)]
    try:
        for path in made:
            path.write_bytes(b"\0")
        remove_shm_buffers(mine)
        assert [p.exists() for p in made] == [False, False, True, True]
    finally:
        for path in made:
            path.unlink(missing_ok=True)
