"""The failing rank's last lines leave a framework's warnings out: what it said before it
died is not buried under UserWarnings. A real log file, read as the orchestrator reads it."""

from __future__ import annotations

from run_benchmarks.running.orchestrator import tail

LOG = """\
step 9 loss 4.51
step 10 loss 4.49
/venv/lib/python3.11/site-packages/megatron/core/tensor_parallel/layers.py:631: UserWarning: async_grad_allreduce is deprecated
  warnings.warn(
/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: a FutureWarning
  return func(*args, **kwargs)
"""


def test_the_last_lines_of_a_killed_rank_skip_framework_warnings(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text(LOG + "".join(f"/m/x.py:{i}: UserWarning: noise {i}\n  warnings.warn(\n" for i in range(30)))
    assert tail(log, 5) == "step 9 loss 4.51\nstep 10 loss 4.49"


def test_an_indented_line_after_other_lines_is_kept(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text('Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nRuntimeError: boom\n')
    assert tail(log) == 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nRuntimeError: boom'
