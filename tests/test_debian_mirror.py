"""The test cluster's base image takes its Debian mirror from the machine's apt sources.

apt itself reads a temporary /etc/apt here (``apt-get -o Dir::Etc=...``): one-line
``sources.list`` entries and deb822 ``.sources`` files alike.
"""

from __future__ import annotations

import shutil

import pytest

from tests.cluster.baseimage import SUITE, debian_mirror

pytestmark = pytest.mark.skipif(shutil.which("apt-get") is None, reason="apt-get is not installed")

DEB822 = """\
Types: deb
URIs: http://deb822.example.org/debian
Suites: {suite} {suite}-updates
Components: main
"""


def etc_apt(tmp_path, *, one_line: str = "", parts: dict[str, str] | None = None):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(one_line)
    for name, text in (parts or {}).items():
        (tmp_path / "sources.list.d" / name).write_text(text)
    return tmp_path


def test_one_line_source(tmp_path):
    d = etc_apt(
        tmp_path,
        one_line=f"deb-src http://src.example.org/debian {SUITE} main\ndeb [arch=amd64] http://one.example.org/debian/ {SUITE} main\n",
    )
    assert debian_mirror(etc_apt=d) == "http://one.example.org/debian"


def test_deb822_source(tmp_path):
    d = etc_apt(tmp_path, parts={"debian.sources": DEB822.format(suite=SUITE)})
    assert debian_mirror(etc_apt=d) == "http://deb822.example.org/debian"


def test_the_suite_decides_and_disabled_entries_are_left_out(tmp_path):
    disabled = DEB822.format(suite=SUITE).replace("deb822.example", "off.example") + "Enabled: no\n"
    d = etc_apt(
        tmp_path,
        one_line="deb http://other.example.org/debian sid main\n",
        parts={"a.sources": disabled, "b.list": f"deb http://parts.example.org/debian {SUITE} main\n"},
    )
    assert debian_mirror(etc_apt=d) == "http://parts.example.org/debian"


def test_no_source_for_the_suite_is_said(tmp_path):
    d = etc_apt(tmp_path, one_line="deb http://other.example.org/debian sid main\n")
    with pytest.raises(RuntimeError, match=rf"no deb source for Debian {SUITE} in .*sources.list.*FLAGBENCH_DEBIAN_MIRROR"):
        debian_mirror(etc_apt=d)


def test_a_malformed_source_names_its_file(tmp_path):
    d = etc_apt(tmp_path, one_line="deb http://x.example.org/debian\n")
    with pytest.raises(RuntimeError, match=rf"reading the apt sources failed: .*{tmp_path / 'sources.list'}"):
        debian_mirror(etc_apt=d)


def test_this_machine_names_one():
    """The machine the suite runs on (Debian, apt) has a source for the suite."""
    assert debian_mirror().startswith(("http://", "https://"))
