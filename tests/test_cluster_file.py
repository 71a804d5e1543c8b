"""Cluster files refused at load, naming the file and the hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from run_benchmarks.errors import InputError
from run_benchmarks.planning.config import ClusterConfig, load


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_one_address_listed_twice_is_refused_naming_both_hosts(tmp_path):
    hosts = [
        {"name": "h1", "address": "10.0.0.1"},
        {"name": "h2", "address": "10.0.0.2"},
        {"name": "h3", "address": "10.0.0.1", "port": 22},
    ]
    path = _write(tmp_path, {"backend": "ssh", "hosts": hosts})
    with pytest.raises(InputError) as info:
        load(ClusterConfig, path)
    assert str(path) in str(info.value)
    assert "'h1' and 'h3' are one host: both 10.0.0.1 port 22" in str(info.value)


def test_one_address_on_two_ports_is_two_hosts(tmp_path):
    hosts = [{"name": "h1", "address": "127.0.0.1", "port": 2201}, {"name": "h2", "address": "127.0.0.1", "port": 2202}]
    assert [h.name for h in load(ClusterConfig, _write(tmp_path, {"backend": "ssh", "hosts": hosts})).hosts] == ["h1", "h2"]
