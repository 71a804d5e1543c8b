"""Local runs that name their devices (the vendor's visible-devices variable, here
CUDA_VISIBLE_DEVICES) lock only those: runs on disjoint devices go side by side, a run on a
device in use is refused naming the device and its holder, and a whole-host run and a device run
exclude each other. Real flocks in a lock folder of the test's own; the plans are stand-ins with
the two fields the lock reads (no GPU here, so no run is started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from run_benchmarks.errors import InputError
from run_benchmarks.running.runtimes.local import LocalRuntime, claimed_devices

VAR = "CUDA_VISIBLE_DEVICES"


def plan(run_id: str, var: str | None = VAR) -> SimpleNamespace:
    return SimpleNamespace(run_id=run_id, vendor=SimpleNamespace(visible_devices_env=var))


@pytest.fixture
def take(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGBENCH_LOCK_DIR", str(tmp_path / "locks"))
    held: list[LocalRuntime] = []

    def _take(run_id: str, devices: str | None, var: str | None = VAR) -> LocalRuntime:
        if devices is None:
            monkeypatch.delenv(VAR, raising=False)
        else:
            monkeypatch.setenv(VAR, devices)
        rt = LocalRuntime()
        rt._take_lock(plan(run_id, var))
        held.append(rt)
        return rt

    yield _take
    for rt in held:
        rt.cleanup()


def test_claimed_devices_read_the_variable(monkeypatch):
    monkeypatch.setenv(VAR, "3, 1,1")
    assert claimed_devices(VAR) == [1, 3]
    assert claimed_devices(None) is None  # a vendor without the variable (cpu): the whole host
    for value in ("", " ", "GPU-5b1c2d3e-0000-1111-2222-333344445555"):  # unset, empty, UUIDs
        monkeypatch.setenv(VAR, value)
        assert claimed_devices(VAR) is None
    monkeypatch.delenv(VAR)
    assert claimed_devices(VAR) is None


def test_disjoint_devices_run_side_by_side_and_overlaps_are_refused(take, tmp_path):
    a = take("run-a", "0,1")
    take("run-b", "2,3")
    with pytest.raises(InputError) as err:
        take("run-c", "1,2")
    msg = str(err.value)
    assert msg.startswith("device 1 of this host is busy: run run-a (pid ")
    assert f"holds {tmp_path / 'locks' / 'local.device1.lock'}" in msg
    assert "one run at a time per device (CUDA_VISIBLE_DEVICES=1,2 names the devices this run takes" in msg

    with pytest.raises(InputError) as err:  # the whole host while device runs hold it: both named
        take("run-w", None)
    msg = str(err.value)
    assert msg.startswith("this host is busy: run run-a (pid ") and "on devices 0, 1;" in msg and "run run-b (pid " in msg
    assert "one run at a time per host" in msg

    a.cleanup()  # run-a ends: devices 0 and 1 are free again; device 2 stays run-b's
    take("run-d", "0,1")
    with pytest.raises(InputError, match=r"device 2 of this host is busy: run run-b"):
        take("run-e", "2")


def test_a_whole_host_run_excludes_device_runs_and_frees_them(take, tmp_path):
    w = take("run-w", None, var=None)  # a vendor without the variable (cpu) takes the whole host
    with pytest.raises(InputError) as err:
        take("run-a", "0")
    assert str(err.value).startswith("this host is busy: run run-w (pid ")
    assert "for the whole host" in str(err.value)
    with pytest.raises(InputError, match="this host is busy: run run-w"):
        take("run-x", "7", var=None)  # the variable set but not this vendor's: the whole host again
    w.cleanup()
    a = take("run-a", "0")
    a.cleanup()
    take("run-w2", None)  # a refused device run kept nothing: the whole host is free after run-a


def test_a_device_run_records_the_runs_beside_it(take):
    from run_benchmarks.judging.results import beside_lines

    a = take("run-a", "0,1")
    assert a.describe() == {"devices_claimed": [0, 1], "runs_beside": []}
    assert beside_lines(a.describe()) == [
        "",
        "Devices: this run claimed device(s) 0, 1 of its host; no other run held a device of it meanwhile.",
    ]
    b = take("run-b", "3")
    (seen,) = b.describe()["runs_beside"]  # run-a was there when run-b started
    assert seen.startswith("run run-a (pid ") and seen.endswith(" on devices 0, 1")
    info = a.describe()  # after a round: run-b seen, and kept once run-b has ended
    b.cleanup()
    a.cleanup()
    assert a.describe() == info and info["devices_claimed"] == [0, 1]
    (seen,) = info["runs_beside"]
    assert seen.startswith("run run-b (pid ") and seen.endswith(" on device 3")
    (line,) = beside_lines(info)[1:]
    assert line.startswith("Devices: this run claimed device(s) 0, 1 of its host, beside run run-b (pid ")
    assert take("run-w", None, var=None).describe() == {}  # a whole-host run has no one beside it
