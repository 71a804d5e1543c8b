"""The order of a failed round's error: the lost node first (a node killed from outside,
exit 137 read as SIGKILL; a node the runtime lost), the survivor's collective error after
it; an error every node shares (a job's time limit) said once, naming no node."""

from __future__ import annotations

import time
from pathlib import Path

from run_benchmarks.planning import plan as planning
from run_benchmarks.planning.casename import CaseName
from run_benchmarks.planning.config import ClusterConfig
from run_benchmarks.running import causes, orchestrator
from run_benchmarks.running.runtimes.base import NodeOutcome
from training.metriclog import MetricLogger

GLOO = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:40123"


def _plan(tmp_path):
    cn = CaseName.parse("llama3_8b:megatron:H100:1:2")
    return planning.build(cn, "nvidia", ClusterConfig(), tmp_path, sets=["train.steps=2", "train.warmup_steps=0"])


def _node(tmp_path: Path, k: int, error: str | None = None) -> Path:
    node = tmp_path / "round1" / f"node{k}"
    (node / "ranks" / "0").mkdir(parents=True)
    with open(node / "ranks" / "0" / "stderr.log", "w") as fh:
        fh.write("UserWarning: a framework warning\n")
        if error:
            fh.write(f"[rank{k}]: {error}\n")
            MetricLogger(run="r", rank=k, stream=fh).error(f"{error}\nTraceback (most recent call last):")
    return node


def _round(tmp_path, outcomes):
    return orchestrator.evaluate_round(_plan(tmp_path), 1, outcomes, time.monotonic())


def test_a_node_killed_from_outside_leads_the_survivors_collective_error(tmp_path):
    survivor = NodeOutcome("h1", 0, 1, False, _node(tmp_path, 0, GLOO))
    killed = NodeOutcome("h2", 1, 137, False, _node(tmp_path, 1))
    lines = _round(tmp_path, [survivor, killed]).error.splitlines()
    assert lines[0] == "node1 (h2): killed by SIGKILL (exit status 137)", lines
    assert lines[1] == f"rank 0: {GLOO}", lines
    first = lines[1]
    assert causes.rest_at(tmp_path / "round1", first) == tmp_path / "round1" / "node0" / "ranks" / "0" / "stderr.log"


def test_a_lost_node_leads_and_a_node_stopped_by_sigterm_comes_last(tmp_path):
    stopped = NodeOutcome("n1", 0, 143, False, _node(tmp_path, 0))
    lost = NodeOutcome("n2", 1, None, False, _node(tmp_path, 1), "Slurm job 7 ended NODE_FAIL: node n2 DOWN", {causes.LOST_KEY: True})
    lines = _round(tmp_path, [stopped, lost]).error.splitlines()
    assert lines[0] == "node1 (n2): Slurm job 7 ended NODE_FAIL: node n2 DOWN", lines
    assert "node0 (n1): exit status 143 (SIGTERM)" in lines[1:], lines


def test_an_error_of_the_whole_job_names_no_node(tmp_path):
    limit = "Slurm job 7 reached its time limit 00:01:00 (TIMEOUT)"
    outs = [NodeOutcome(f"n{k + 1}", k, None, True, _node(tmp_path, k), limit) for k in (0, 1)]
    lines = _round(tmp_path, outs).error.splitlines()
    assert lines[0] == limit and limit not in lines[1:], lines


def test_exit_codes_read_as_signals():
    assert [causes.exit_signal(c) for c in (137, -9, 143, 1, 0, 255, None)] == ["SIGKILL", "SIGKILL", "SIGTERM", None, None, None, None]


def test_the_harness_stop_shared_by_every_node_names_the_nodes_it_concerns(tmp_path):
    """The startup and stall timeouts stop every node with one line: said once, led by the
    nodes it concerns (marked by the round's watch), under any runtime of several nodes."""
    start = "no rank started training within 10 s of launch (startup_timeout_s): a node that never joined; stopped"
    outs = [NodeOutcome(f"n{k + 1}", k, None, False, _node(tmp_path, k), start, {causes.BLAME_KEY: True}) for k in (0, 1)]
    lines = _round(tmp_path, outs).error.splitlines()
    assert lines[0] == f"node0 (n1), node1 (n2): {start}" and start not in "\n".join(lines[1:]), lines
    stall = "no record from any rank for 4 s after step 3 (stall_timeout_s): the ranks hang; stopped (Slurm job 7 cancelled)"
    outs = [NodeOutcome(f"n{k + 1}", k, None, False, tmp_path / "round1" / f"node{k}", stall, {causes.BLAME_KEY: k == 1}) for k in (0, 1)]
    assert _round(tmp_path, outs).error.splitlines()[0] == f"node1 (n2): {stall}"


def test_a_node_whose_engine_was_lost_leads_rank_0s_gloo_error(tmp_path):
    survivor = NodeOutcome("h1", 0, 1, False, _node(tmp_path, 0, GLOO))
    lost = NodeOutcome(
        "h2",
        1,
        -1,
        False,
        _node(tmp_path, 1),
        "lost the node: docker engine not answering over ssh: no reply within 60 s",
        {causes.LOST_KEY: True},
    )
    lines = _round(tmp_path, [survivor, lost]).error.splitlines()
    assert lines[0] == "node1 (h2): lost the node: docker engine not answering over ssh: no reply within 60 s", lines
    assert lines[1] == f"rank 0: {GLOO}", lines


def test_a_startup_stop_says_where_each_rank_waited(tmp_path):
    """A round stopped for never starting to train reads the ranks' stack files as a stall
    does: the ranks write them before the startup timeout (training/case.py)."""
    start = "no rank started training within 60 s of launch (startup_timeout_s): a node that never joined; stopped"
    node = _node(tmp_path, 0)
    (node / "stacks").mkdir()
    (node / "stacks" / "rank0.txt").write_text(
        "Timeout (0:00:40)!\nThread 0x00007f0000000001 (most recent call first):\n"
        '  File "/env/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 189 in _create_c10d_store\n'
        '  File "/w/cases/llama3/megatron/train.py", line 99 in init_distributed\n'
        '  File "/w/cases/llama3/megatron/train.py", line 400 in <module>\n'
    )
    lines = _round(tmp_path, [NodeOutcome("h1", 0, None, False, node, start)]).error.splitlines()
    assert lines[0] == f"node0 (h1): {start}", lines
    assert lines[1:3] == [
        "rank 0 on node0 (h1): waited in _create_c10d_store (torch/distributed/rendezvous.py:189), "
        "called from init_distributed (cases/llama3/megatron/train.py:99)",
        "rank 1 on node0 (h1): no stack written by its timeout (a stopped process, or one that never reached it, writes none)",
    ], lines
