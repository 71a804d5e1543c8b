"""The framework launchers, as argument lists.  One class per launcher.

Each builds the command a node runs: the framework's own launcher, which
starts ``nprocs`` ranks of the case's entry point.  No shell is involved;
runtimes quote argv only where a remote shell is unavoidable.
"""

from __future__ import annotations

import base64
import dataclasses
import json

#: stands for the node's own address in a launcher's env; the node agent fills it in
NODE_ADDR = "@@FB_NODE_ADDR@@"


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    python: str
    nnodes: int
    nprocs: int
    node_rank: int
    master_addr: str
    master_port: int
    entry: str  # path of the case's entry point
    config: str  # path of resolved.json
    log_dir: str  # per-node directory for per-rank logs
    device: str  # the vendor's device type (cuda, npu, ... or cpu)
    rdzv_id: str = "none"  # one per run and round: a launcher never joins another run's rendezvous


class Launcher:
    name = ""

    def command(self, s: LaunchSpec) -> list[str]:
        raise NotImplementedError

    def files(self, s: LaunchSpec) -> dict[str, str]:
        """Files the command needs beside resolved.json (name -> content), the same on every node."""
        return {}

    def env(self, s: LaunchSpec) -> dict[str, str]:
        """Environment the launcher needs on each node (may hold NODE_ADDR)."""
        return {}

    def leftovers(self, s: LaunchSpec) -> list[str]:
        """Glob patterns of files the round's ranks leave on a node and nothing else removes;
        whoever ran the launcher there deletes them when it has exited."""
        return []


class Torchrun(Launcher):
    name = "torchrun"

    def command(self, s: LaunchSpec) -> list[str]:
        return [
            s.python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(s.nnodes),
            "--nproc-per-node",
            str(s.nprocs),
            "--node-rank",
            str(s.node_rank),
            "--master-addr",
            s.master_addr,
            "--master-port",
            str(s.master_port),
            "--rdzv-id",
            s.rdzv_id,
            "--log-dir",
            s.log_dir,
            "--redirects",
            "3",
            "--tee",
            "3",
            s.entry,
            "--config",
            s.config,
        ]


class DeepSpeed(Launcher):
    """DeepSpeed's per-node launcher, ``deepspeed.launcher.launch``: what DeepSpeed's own
    multi-node runners start on every node. The harness is that runner here (it starts each
    node itself), so DeepSpeed's front end (``deepspeed.launcher.runner``), which would only
    build this command in one more interpreter importing torch and DeepSpeed, is not run."""

    name = "deepspeed"

    def command(self, s: LaunchSpec) -> list[str]:
        # the world as the front end encodes it for --num_nodes N --num_gpus M: each node's
        # local device ids (names are labels); launch sets the visible devices from them
        world = {f"node{k}": list(range(s.nprocs)) for k in range(s.nnodes)}
        info = base64.urlsafe_b64encode(json.dumps(world).encode()).decode()
        return [
            s.python,
            "-u",
            "-m",
            "deepspeed.launcher.launch",
            "--world_info",
            info,
            "--node_rank",
            str(s.node_rank),
            "--master_addr",
            s.master_addr,
            "--master_port",
            str(s.master_port),
            "--enable_each_rank_log",
            s.log_dir,
            s.entry,
            "--config",
            s.config,
        ]

    def leftovers(self, s: LaunchSpec) -> list[str]:
        # on CPU, when all ranks share a host (the launcher sets LOCAL_SIZE), DeepSpeed's shm
        # all-reduce maps one 66 MB buffer per rank, /dev/shm/deepspeed_allreduce_buffer_
        # <n>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, and never unlinks it: memory held until reboot
        return [f"/dev/shm/deepspeed_allreduce_buffer_*_*_{s.master_port}_*"]


class Paddle(Launcher):
    name = "paddle"

    def command(self, s: LaunchSpec) -> list[str]:
        argv = [s.python, "-m", "paddle.distributed.launch", "--log_dir", s.log_dir]
        if s.nnodes > 1:
            argv += ["--master", f"{s.master_addr}:{s.master_port}", "--nnodes", str(s.nnodes), "--rank", str(s.node_rank)]
        if s.device != "cpu":  # one accelerator per rank, of the type paddle's build has (gpu, xpu, a custom device)
            argv += ["--devices", ",".join(str(i) for i in range(s.nprocs))]
        else:
            argv += ["--nproc_per_node", str(s.nprocs)]
        return argv + [s.entry, "--config", s.config]

    def env(self, s: LaunchSpec) -> dict[str, str]:
        # across nodes paddle's launcher compares its own address with --master to decide who
        # serves the rendezvous; it reads that address from POD_IP
        return {"POD_IP": NODE_ADDR} if s.nnodes > 1 else {}


LAUNCHERS: dict[str, Launcher] = {cls.name: cls() for cls in (Torchrun, DeepSpeed, Paddle)}
