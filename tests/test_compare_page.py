"""The --compare page as a vendor engineer reads it, in headless Chromium: the loss chart as wide
as the page, its legend outside the curves, each run named by its run id, host and date, each
run's data shown, and runs of other data drawn apart from the reference run's."""

from __future__ import annotations

import json

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from run_benchmarks.judging import compare
from tests.test_data_compare import start, two_phase_run
from tests.test_report_browser import assert_loads_offline_with_plots, load_page

REAL = {
    ph: {
        "kind": "real",
        "format": "llava",
        "checked": True,
        "json": f"{ph}.json",
        "images": 40,
        "tokenizer": {"size": 40, "sha256": "ab" * 8},
        "fingerprint": f"{ph}0123456789ab"[:16],
    }
    for ph in ("pretrain", "finetune")
}


def test_the_compare_page_in_chromium(tmp_path):
    vendor = two_phase_run(tmp_path / "vendor.json", "iluvatar", (1500.0, 900.0), 1.3, data=REAL)
    again = two_phase_run(tmp_path / "again.json", "nvidia", (990.0, 1010.0), 1.01)
    doc = json.loads(again.read_text())
    doc["run_id"], doc["started"] = "llava_tiny_nvidia_second", "2026-01-02T08:30:00+00:00"
    again.write_text(json.dumps(doc))
    nvidia = two_phase_run(tmp_path / "nvidia.json", "nvidia", (1000.0, 1000.0), 1.0)
    out = tmp_path / "cmp"
    proc = start("--compare", str(vendor), str(again), str(nvidia), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    shot = tmp_path / "compare.png"
    page = load_page(out / "compare.html", tmp_path / "profile", width=1400, shot=shot)
    assert_loads_offline_with_plots(page, plots=4)
    assert shot.stat().st_size > 10_000
    charts = {i["alt"]: i for i in page["images"]}
    assert sorted(charts) == ["loss finetune", "loss finetune, other data", "loss pretrain", "loss pretrain, other data"]
    assert all(i["box"][0] >= 0.95 * page["body_width"] for i in page["images"])  # full width, not 560 px
    text = page["text"]
    # the two nvidia runs of one config, told apart by run id and date
    assert "run 2: nvidia cpu x2 config_cpux1x2 (llava_tiny_nvidia_second, " in text and ", 2026-01-02 08:30)" in text
    assert "reference: nvidia cpu x2 config_cpux1x2 (llava_tiny_nvidia, " in text
    # each run's data, per phase
    assert "llava pretrain.json, 40 images, tokenizer of 40 ids, fingerprint pretrain01234567" in text
    assert text.count("synthetic (the harness's own corpus)") == 4 and page["tables"] == 3
    md = (out / "compare.md").read_text()
    assert "data: pretrain llava pretrain.json, 40 images" in md


def test_the_legend_lies_outside_the_curves():
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([1, 2, 3], [7.0, 6.5, 6.2], label="run 1: a long label, its run id, host and date")
    compare._legend_below(ax)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    legend, axes = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.y1 <= axes.y0  # under the axes: no curve covered
