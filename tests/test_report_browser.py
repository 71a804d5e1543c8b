"""The report pages in a real headless Chromium: no script or console errors, no network
request, every plot an image that decoded to a non-zero size.

Chromium is driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``:
JSON messages ended by NUL on file descriptors 3 and 4), so nothing beyond the standard
library is needed.  tests/install_system_deps.sh installs Chromium.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from run_benchmarks.nightly import history, report
from tests.test_history import HW, fake_results

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--remote-debugging-pipe",
]

PROBE = """JSON.stringify({
  title: document.title,
  tables: document.querySelectorAll("table").length,
  text: document.body.innerText,
  images: Array.from(document.images).map(i => {
    const r = i.getBoundingClientRect();
    return {alt: i.alt, complete: i.complete, natural: [i.naturalWidth, i.naturalHeight], box: [r.width, r.height], src: i.src.slice(0, 22)};
  }),
  svgs: Array.from(document.querySelectorAll("svg")).map(s => [s.getBoundingClientRect().width, s.getBoundingClientRect().height]),
  links: Array.from(document.querySelectorAll("a[href]")).map(a => a.getAttribute("href")),
  body_width: document.body.getBoundingClientRect().width,
})"""


class Chromium:
    """A headless Chromium and one DevTools session over the pipe."""

    def __init__(self, profile: Path) -> None:
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if not exe:
            pytest.skip("chromium is not installed (tests/install_system_deps.sh)")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # the child reads commands on fd 3 and answers on fd 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=fds,
            pass_fds=(3, 4),
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._id, self.events = b"", 0, []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError(
                    f"chromium exited: {self.proc.stderr.read().decode(errors='replace')[-2000:] if self.proc.stderr else ''}"
                )
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def call(self, method: str, params: dict[str, Any] | None = None, session: bool = False, timeout: float = 60) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_for(self, event: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            self.events.append(self._read(deadline))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except Exception:  # already gone
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


def load_page(page: Path, profile: Path, width: int | None = None, shot: Path | None = None, probe: str | None = None) -> dict[str, Any]:
    """Open ``page`` (in a window ``width`` pixels wide); return what the page holds and every
    error or request it caused; with ``shot``, a PNG of the whole page is written there; ``probe``:
    a further expression whose JSON value comes back under ``probe``."""
    import base64

    chrome = Chromium(profile)
    try:
        if width:
            metrics = {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}
            chrome.call("Emulation.setDeviceMetricsOverride", metrics, session=True)
        chrome.call("Page.navigate", {"url": page.resolve().as_uri()}, session=True)
        chrome.wait_for("Page.loadEventFired")
        found = json.loads(chrome.call("Runtime.evaluate", {"expression": PROBE, "returnByValue": True}, session=True)["result"]["value"])
        if probe:
            found["probe"] = json.loads(
                chrome.call("Runtime.evaluate", {"expression": probe, "returnByValue": True}, session=True)["result"]["value"]
            )
        if shot:
            png = chrome.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=True)["data"]
            shot.write_bytes(base64.b64decode(png))
    finally:
        chrome.close()
    errors = []
    for ev in chrome.events:
        method, p = ev.get("method"), ev.get("params", {})
        if method == "Runtime.exceptionThrown":
            errors.append(
                "Uncaught " + p["exceptionDetails"].get("exception", {}).get("description", p["exceptionDetails"].get("text", ""))
            )
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append("console.error " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            errors.append(f"log {p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        elif method == "Network.loadingFailed":
            errors.append(f"loading failed: {p.get('errorText')}")
    requests = [ev["params"]["request"]["url"] for ev in chrome.events if ev.get("method") == "Network.requestWillBeSent"]
    return {**found, "errors": errors, "requests": requests}


def assert_loads_offline_with_plots(result: dict[str, Any], plots: int) -> None:
    assert result["errors"] == []
    # only the page itself: no CDN, no font or script fetched from anywhere
    assert all(u.startswith(("file://", "data:")) for u in result["requests"]), result["requests"]
    imgs = result["images"]
    assert len(imgs) + len(result["svgs"]) >= plots, imgs
    for img in imgs:
        assert img["complete"] and img["src"] == "data:image/png;base64,", img
        assert min(img["natural"]) > 50 and min(img["box"]) > 50, img  # decoded, laid out, not zero-sized


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """Two nights of constructed results: a baseline and a regressed night with a failed round."""
    tmp = tmp_path_factory.mktemp("report")
    db = history.connect(tmp / "h.sqlite")
    out = tmp / "reports"
    paths = {}
    for n, (tps, verdict) in enumerate(
        [([1000.0, 1010.0, 990.0, 1005.0, 995.0], "baseline: none"), ([600.0, None, 610.0], "regressed")], 1
    ):
        started = f"2026-01-0{n}T02:00:00+00:00"
        night = history.start_night(db, started, "/ci/nightly.yaml", "cases: []\n", "ci-host")
        res = fake_results(f"llama3_tiny_megatron_cpux1x2_2026010{n}-020000-000000", tps, started=started, aligned=True)
        findings = (
            []
            if n == 1
            else [
                {
                    "metric": "tokens/p/s",
                    "baseline": 1000.0,
                    "now": 605.0,
                    "change": -0.395,
                    "tolerance": -0.1,
                    "message": "llama3_tiny:megatron:cpu:1:2 on cpu (config_cpux1x2): tokens/p/s median 605 vs baseline 1000 <&>",
                }
            ]
        )
        history.record_run(
            db,
            night,
            res,
            hardware=HW,
            variant=None,
            rounds_requested=len(tps),
            verdict=verdict,
            baseline_runs=n - 1,
            findings=findings,
            baseline={"train": {"tokens_per_gpu_s": 1000.0}} if n > 1 else {},
            tolerances={"throughput_drop_pct": 10.0},
            reference={"train": {s: 7.0 - 0.1 * s for s in range(1, 31)}},
            run_dir=f"/logs/{res.run_id}",
        )
        page = report.write_night(db, night, out, 1 if findings else 0)
        history.finish_night(db, night, started, 1 if findings else 0, str(page))
        paths[f"night{n}"] = page
    paths["index"] = report.write_index(db, out)
    return paths


def test_night_page_in_chromium(pages, tmp_path):
    r = load_page(pages["night2"], tmp_path / "profile")
    assert_loads_offline_with_plots(r, plots=3)  # loss vs reference, throughput per round, trend
    assert r["title"].startswith("flagbench nightly") and r["tables"] >= 3
    text = r["text"]
    assert "llama3_tiny:megatron:cpu:1:2" in text and "regressed" in text
    assert "tokens/p/s median 605 vs baseline 1000 <&>" in text  # escaped in the HTML, shown as written
    assert "2 of 3 round(s) ok, 0 unjudged, 0 invalid, 1 failed" in text
    assert "failed: -" not in text and "\tfailed\t" in text  # the failed round: its status, and no figure shown as a result
    assert "index.html" in r["links"]


def test_index_page_in_chromium(pages, tmp_path):
    r = load_page(pages["index"], tmp_path / "profile")
    assert_loads_offline_with_plots(r, plots=1)
    assert [link for link in r["links"] if link.startswith("nightly-")] == [pages["night2"].name, pages["night1"].name]
    assert "regression or failure" in r["text"]


def test_the_checker_sees_errors_and_broken_images(tmp_path):
    """The browser check itself: a page with an uncaught error and a broken image fails it."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><html><head><title>t</title></head><body>"
        '<img src="data:image/png;base64,AAAA" alt="broken"><script>console.error("boom"); null.x;</script></body></html>'
    )
    r = load_page(bad, tmp_path / "profile")
    assert any("Uncaught TypeError" in e for e in r["errors"]), r["errors"]
    assert any("boom" in e for e in r["errors"]), r["errors"]
    with pytest.raises(AssertionError):
        assert_loads_offline_with_plots(r, plots=1)


def test_a_two_phase_run_with_invalid_rounds(tmp_path):
    """Every phase gets its rows; the figures of rounds that are not ok carry their status (HTML, no browser)."""
    db = history.connect(tmp_path / "h.sqlite")
    night = history.start_night(db, "2026-01-03T02:00:00+00:00", "/ci/nightly.yaml", "cases: []\n", "ci-host")
    res = fake_results(
        "llava_tiny_deepspeed_cpux1x2_20260103-020000-000000", [600.0, 610.0], aligned=False, phases=("pretrain", "finetune")
    )
    history.record_run(
        db,
        night,
        res,
        hardware=HW,
        variant=None,
        rounds_requested=2,
        verdict="regressed",
        baseline_runs=0,
        findings=[{"metric": "loss alignment", "phase": "finetune", "message": "finetune no longer aligns"}],
    )
    page = report.write_night(db, night, tmp_path / "reports", 1).read_text()
    assert page.count("invalid: 600.0") == 2 and page.count("invalid: 610.0") == 2  # both phases of both rounds
    assert "<td>pretrain</td>" in page and "<td>finetune</td>" in page and "finetune no longer aligns" in page
    assert "0 of 2 round(s) ok, 0 unjudged, <b>2 invalid, 0 failed</b>" in page
