"""The start-up phases (training/startup.py): each the seconds from the mark before it, the first
from the process's own start (the kernel's record of it), the conformance check left out of the
time to the first step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_phases_run_from_the_process_start_and_leave_the_check_out():
    code = textwrap.dedent(
        """
        import json, time
        from training import startup
        time.sleep(0.3); startup.mark("imports")
        time.sleep(0.5); startup.mark("conformance")
        time.sleep(0.2); startup.mark("model")
        time.sleep(0.1); startup.mark("model")  # a part marked twice adds up
        print(json.dumps(startup.record()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    r = json.loads(out)
    p = r["phases"]
    assert list(p) == ["imports", "conformance", "model"] and r["process_start"] == "proc"
    assert p["imports"] >= 0.3 and 0.5 <= p["conformance"] < 1.5 and 0.3 <= p["model"] < 1.3, p
    assert abs(r["to_first_step_s"] - (p["imports"] + p["model"])) < 0.01
