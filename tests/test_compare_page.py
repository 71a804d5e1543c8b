"""The --compare page as a vendor engineer reads it, in headless Chromium: each run's verdict first;
interactive charts (plotly, written into the page: no network) as wide as the page, of the loss per
step with the judged steps shaded and a button that zooms to them, of each run's relative
difference to the reference run per step, and of tokens/p/s per step; legends under the axes in
13 px text; each run named by vendor, card, config, layout, data, run id, host and date; runs of
other data drawn apart."""

from __future__ import annotations

import json

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


CHARTS = """JSON.stringify(Array.from(document.querySelectorAll("figure.chart")).map(f => {
  const gd = f.querySelector(".js-plotly-plot");
  const plot = gd.querySelector(".nsewdrag").getBoundingClientRect(), legend = gd.querySelector(".legend").getBoundingClientRect();
  const menu = (gd.layout.updatemenus || [])[0];
  return {
    id: gd.id, title: f.dataset.title, width: f.getBoundingClientRect().width,
    traces: gd.data.map(t => ({name: t.name, points: t.x.length, dash: (t.line || {}).dash || null, mode: t.mode})),
    legend_below: legend.top >= plot.bottom, legend_px: parseFloat(getComputedStyle(gd.querySelector(".legendtext")).fontSize),
    shapes: (gd.layout.shapes || []).length, judged: menu ? menu.buttons[1].args[0]["xaxis.range"] : null,
  };
}))"""


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
    page = load_page(out / "compare.html", tmp_path / "profile", width=1400, shot=shot, probe=CHARTS)
    assert_loads_offline_with_plots(page, plots=8)  # plotly's charts are SVG, drawn from the page's own script
    assert shot.stat().st_size > 10_000
    charts = {c["id"]: c for c in page["probe"]}
    per_phase = ("loss-{}", "diff-{}", "tps-{}", "other-{}")
    assert sorted(charts) == sorted(k.format(ph) for ph in ("pretrain", "finetune") for k in per_phase)
    for c in charts.values():
        assert c["width"] >= 0.95 * page["body_width"] and c["legend_below"] and c["legend_px"] >= 12, c
    loss = charts["loss-pretrain"]
    # the reference drawn first, wide and dashed, the other run on it with markers: an equal run stays visible
    assert [t["name"].split(" (")[0] for t in loss["traces"]] == [
        "reference: nvidia cpu x2 config_cpux1x2 PP1DP2TP1, data synthetic",
        "run 2: nvidia cpu x2 config_cpux1x2 PP1DP2TP1, data synthetic",
    ]
    assert loss["traces"][0]["dash"] == "dash" and loss["traces"][1]["mode"] == "lines+markers" and loss["traces"][1]["points"] == 30
    assert loss["shapes"] == 1 and loss["judged"] == [20.5, 30.5]  # the judged steps shaded; the button zooms to them
    assert [t["name"].split(":")[0] for t in charts["diff-pretrain"]["traces"]] == ["run 2"] and charts["diff-pretrain"]["shapes"] == 3
    assert len(charts["tps-pretrain"]["traces"]) == 3 and [t["name"].split(":")[0] for t in charts["other-pretrain"]["traces"]] == ["run 1"]
    text = page["text"]
    # the verdicts first: each run's own gate and, against the reference run, its ratio and loss MRE
    verdicts = text.index("Verdicts")
    assert verdicts < text.index("Figures") and verdicts < text.index("Data")
    assert (
        "run 2: nvidia cpu x2 config_cpux1x2 PP1DP2TP1, data synthetic: pretrain: aligned (1.00 %); against the reference run: ratio 0.990, loss MRE 1.00%"
        in text
    )
    # the two nvidia runs of one config, told apart by run id and date
    assert (
        "run 2: nvidia cpu x2 config_cpux1x2 PP1DP2TP1, data synthetic (llava_tiny_nvidia_second, " in text
        and ", 2026-01-02 08:30)" in text
    )
    assert "reference run (its own rounds: ok)" in text and "ratio is tokens/p/s over the reference run's" in text
    assert "llava pretrain.json, 40 images, tokenizer of 40 ids, fingerprint pretrain01234567" in text
    assert page["tables"] == 3
    md = (out / "compare.md").read_text()
    assert (
        "data: pretrain llava pretrain.json, 40 images" in md
        and "- run 2: nvidia cpu x2 config_cpux1x2 PP1DP2TP1, data synthetic: pretrain:" in md
    )
