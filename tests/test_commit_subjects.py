"""Commit messages read in one line: a subject of at most 72 characters (a body says the rest),
for every commit since the rule was kept (the commits before it stay as they were written)."""

from __future__ import annotations

import subprocess

import pytest

from run_benchmarks.planning.registry import ROOT

#: the first commit kept to the rule
SINCE = "cb4e4e4"
LIMIT = 72
#: commits over the limit that stay as written, each with why: rewording one would give it and
#: every commit after it new ids, and committed results name those ids as the code that ran
KEPT = {
    "84b5afa": "docs/results/runs/2026-12-01_llama3_8b_H200x1_*.json were made by code 09a64f7, after it",
    "9f21352": "docs/results/runs/2026-12-02_llava1.5_7b_H200x1_short-fused-rope.json was made by this code",
}


def test_commit_subjects_fit_one_line():
    if subprocess.run(["git", "cat-file", "-e", f"{SINCE}^{{commit}}"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip(f"this clone's history does not reach {SINCE}")
    log = subprocess.run(["git", "log", "--format=%h %s", f"{SINCE}^..HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    subjects = [line.split(" ", 1) for line in log.stdout.splitlines()]
    assert subjects, "no commit read"
    long = [f"{h} ({len(s)} characters): {s}" for h, s in subjects if len(s) > LIMIT and h[:7] not in KEPT]
    assert not long, long
