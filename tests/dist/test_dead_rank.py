"""A rank that dies (or goes silent) mid-step makes every other rank exit non-zero with a message.

2 replicas x 2 stages of GPT-2; rank 1 (replica 0, last stage) stops in its second forward of step 1:

* ``exit``: it calls ``os._exit(17)``. Rank 0 waits on it (a gradient receive) and sees the closed
  connection at once; ranks 2 and 3 (the other replica) are not its pipeline neighbours and fail in
  the gradient all-reduce or through ranks that already exited. All must be gone well within the
  20 s group timeout.
* ``hang``: it sleeps 10 s (then exits 18). Nothing closes, so rank 0 must give up by the 5 s group
  timeout, and its exit brings down the others.
"""

from __future__ import annotations

import os
import re

import pytest

import pipeline_harness as H

DIE_RANK = 1


@pytest.mark.parametrize(
    "mode, timeout_s, hang_s, code",
    [("exit", 20.0, None, 17), ("hang", 5.0, 10.0, 18)],
)
def test_failed_rank_stops_every_other_rank(tmp_path, mode, timeout_s, hang_s, code):
    workdir = str(tmp_path)
    codes, elapsed = H.launch(4, H.dead_rank_worker, (workdir, DIE_RANK, timeout_s, hang_s), deadline_s=90)
    assert None not in codes, f"ranks still running after {elapsed:.0f} s (killed): exit codes {codes}"
    assert codes[DIE_RANK] == code
    survivors = [r for r in range(4) if r != DIE_RANK]
    assert all(codes[r] == 1 for r in survivors), f"exit codes {codes}\n{H.failures(workdir, 4)}"
    messages = {r: open(os.path.join(workdir, f"rank{r}.err")).read() for r in survivors}
    for r, text in messages.items():
        assert f"rank {r} failed: PipelineError: " in text, f"rank {r}: {text}"  # exit_on_error
        assert f"PipelineError: rank {r} " in text and "step 1" in text, text
    # the neighbour names the instruction and the peer: a transfer with rank 1, usually the WAIT on it, but
    # gloo may already report the closed connection when the next send or receive is started
    assert "(peer rank 1)" in messages[0], messages[0]
    assert re.search(r"instruction 0(WAIT_)?(SEND|RECV)_[FB]\d+ ", messages[0]), messages[0]
    if mode == "hang":
        assert "Timed out" in messages[0], messages[0]
    # every survivor reported (its .err file written just before exiting) within the timeout of the stop
    stopped_at = float(open(os.path.join(workdir, "stopped_at")).read())
    delays = {r: os.path.getmtime(os.path.join(workdir, f"rank{r}.err")) - stopped_at for r in survivors}
    assert all(0 <= d < timeout_s + 3 for d in delays.values()), delays
    if mode == "exit":
        assert max(delays.values()) < 5, delays  # closed sockets are noticed at once, no timeout needed


def test_silent_peer_in_a_gather_is_a_pipeline_error_naming_the_rank(tmp_path):
    """The trainer's per-step gathers (measured times, task losses, timelines, weights) fail like transfers:
    a PipelineError naming this rank and what was being gathered, within the group timeout."""
    codes, elapsed = H.launch(2, H.silent_gather_worker, (str(tmp_path), 2.0), deadline_s=60)
    assert codes == [0, 0], codes
    message = open(os.path.join(tmp_path, "gather.err")).read()
    assert message.startswith("PipelineError: rank 0 (stage 0, replica 0), gathering step 3's measured stage "
                              "times failed: "), message
    assert "Timed out" in message, message
