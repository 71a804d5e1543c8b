"""A paced run: each optimizer step is followed by a sleep, so that a run which must outlast
what a test does to it (a killed node, a Slurm time limit, a lost host) trains on without
taking the machine's cores from the work beside it. The ``_paced`` configs of the cpu vendor
name it as their ``hook``; their figures are not a measurement (results.json names the hook)."""

from __future__ import annotations

import time
from typing import Any

#: the sleep after each optimizer step, seconds
PAUSE_S = 0.5


def half_second_steps(cfg: dict[str, Any]) -> None:
    """Sleep ``PAUSE_S`` after every optimizer step of this process (torch's global step hook)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: time.sleep(PAUSE_S))
