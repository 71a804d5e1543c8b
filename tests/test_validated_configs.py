"""A config says ``validated: true`` only where a committed run of it was judged aligned.

``validated_by`` names that run's results.json (docs/results/runs/<file>.json): a run of this
vendor, model and config, with the config's layout as it stands, under a recipe whose committed
reference judges every phase of one of its clean rounds aligned, judged again against the
reference as it is now (config_validation.validation_problem). A run that was not judged, one that is
the reference's own curve or one of its repeats, and one of another layout validate nothing; a
switch the case gained after the run, at its standard value, leaves the run's layout as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from run_benchmarks.planning import registry
from run_benchmarks.tools import config_validation

CONFIGS = sorted(registry.VENDORS_DIR.glob("*/cases/*/*/config_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(registry.VENDORS_DIR)))
def test_a_validated_config_names_an_aligned_run(path: Path) -> None:
    assert config_validation.validation_problem(path) is None


def test_the_llama3_8b_h200_config_is_validated_by_its_run_on_one_card() -> None:
    doc = yaml.safe_load((registry.VENDORS_DIR / "nvidia/cases/llama3_8b/megatron/config_H200x1x1.yaml").read_text())
    assert (
        doc["validated"] is True
        and doc["validated_by"] == "docs/results/runs/2026-12-02_llama3_8b_H200x1_short-offload-pinned-copy-r2.json"
    )


@pytest.fixture
def scratch_config():
    """A config file of llama3_8b's 1 x H200 size, in the vendor's folder while the test runs."""
    path = registry.VENDORS_DIR / "nvidia/cases/llama3_8b/megatron/config_H200x1x1_CHECK.yaml"
    base = yaml.safe_load((path.parent / "config_H200x1x1.yaml").read_text())

    def write(**meta) -> Path:
        doc = {**base, **meta, "description": "a config the test writes"}
        doc = {k: v for k, v in doc.items() if v is not None}
        path.write_text(yaml.safe_dump(doc))
        return path

    yield write
    path.unlink(missing_ok=True)


def test_the_rule_bites(scratch_config) -> None:
    runs = "docs/results/runs/2026-11-29_llama3_8b_H200x1_short-"
    assert "needs validated_by" in config_validation.validation_problem(scratch_config(validated=True, validated_by=None))
    said = config_validation.validation_problem(scratch_config(validated=True, validated_by="docs/results/runs/none.json"))
    assert "no such file" in said
    # the right run, but of another config name
    said = config_validation.validation_problem(scratch_config(validated=True, validated_by=runs + "micro2.json"))
    assert "a run of config 'config_H200x1x1', not 'config_H200x1x1_CHECK'" in said
    assert config_validation.validation_problem(scratch_config(validated=False, validated_by=None)) is None


def test_a_run_not_judged_or_of_another_layout_validates_nothing(tmp_path) -> None:
    """The reference's own repeat (a round 'unjudged' when it ran) and a run of micro batch 1
    where the config holds 2 are refused with why."""
    cfg = registry.VENDORS_DIR / "nvidia/cases/llama3_8b/megatron/config_H200x1x1.yaml"
    text = cfg.read_text()
    try:
        validated_by = yaml.safe_load(text)["validated_by"].rsplit("/", 1)[1]
        sdpa = text.replace(validated_by, "2026-11-29_llama3_8b_H200x1_short-sdpa.json")
        cfg.write_text(sdpa)
        said = config_validation.validation_problem(cfg)
        assert "its layout (parallel, micro batch) is not the config's as it stands" in said, said
        then = "optimizer_offload_fraction: 0.5}"  # the config of that run
        cfg.write_text(
            sdpa.replace("micro_batch: 2", "micro_batch: 1").replace(
                "optimizer_offload_fraction: 0.4, overlap_cpu_optimizer_d2h_h2d: true, pinned_register_threads: 16, offload_pinned_copy: true}",
                then,
            )
        )
        said = config_validation.validation_problem(cfg)
        assert said.endswith("not a run judged aligned: no round of status ok"), said
    finally:
        cfg.write_text(text)


def test_a_switch_added_after_the_run_keeps_its_layout_only_at_the_standard_value() -> None:
    """A parallel switch the case gained after a run counts as the run's at its standard value
    (what the case did before the switch existed), at no other; any other difference of parallel
    values or micro batch, a switch gone since included, is another layout."""
    standard = {"parallel": {"tp": 1, "recompute": "none", "overlap": False}}
    run = {"parallel": {"tp": 1, "recompute": "full"}, "train": {"micro_batch": 2}}
    ours = {"parallel": {"tp": 1, "recompute": "full", "overlap": False}, "train": {"micro_batch": 2}}
    assert config_validation.same_layout(ours, run, standard)
    assert not config_validation.same_layout({**ours, "parallel": {**ours["parallel"], "overlap": True}}, run, standard)
    assert not config_validation.same_layout({**ours, "parallel": {**ours["parallel"], "recompute": "none"}}, run, standard)
    assert not config_validation.same_layout({**ours, "train": {"micro_batch": 1}}, run, standard)
    assert not config_validation.same_layout(ours, {**run, "parallel": {**run["parallel"], "gone": 3}}, standard)
    assert not config_validation.same_layout({**ours, "parallel": {**ours["parallel"], "unknown": 1}}, run, standard)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(registry.VENDORS_DIR)))
def test_a_config_says_what_it_is_in_one_line(path: Path) -> None:
    """History lives in docs/results (config-notes.md keeps what the descriptions said before)."""
    text = str((yaml.safe_load(path.read_text()) or {}).get("description", ""))
    assert text and "\n" not in text and len(text) <= 200, text


def test_the_run_a_reference_was_made_of_validates_nothing() -> None:
    """llava1.5_7b's standard references are one run of config_H200x1x2: that run cannot be judged
    against itself, so it does not validate the config."""
    cfg = registry.VENDORS_DIR / "nvidia/cases/llava1.5_7b/deepspeed/config_H200x1x2.yaml"
    text = cfg.read_text()
    run = "docs/results/runs/2026-11-28_llava1.5_7b_H200x2_hostX-standard-config.json"
    try:
        cfg.write_text(text.replace("validated: false", f"validated: true\nvalidated_by: {run}"))
        said = config_validation.validation_problem(cfg)
        assert "phase pretrain: the run is the one cases/llava/deepspeed/reference/llava1.5_7b/standard.pretrain.json was made of" in said
    finally:
        cfg.write_text(text)
