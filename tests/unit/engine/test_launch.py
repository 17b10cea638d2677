"""The local launcher (``dynabatch train --stages 2`` without torchrun): a rank ended by a signal."""

from __future__ import annotations

import time

from dynabatch.engine.launch import launch_local

KILLED_RANK_1 = ("import os, signal, time\n"
                 "if os.environ['RANK'] == '1':\n"
                 "    time.sleep(0.5)\n"
                 "    os.kill(os.getpid(), signal.SIGKILL)\n"
                 "time.sleep(60)\n")


def test_a_rank_killed_by_a_signal_is_named_and_exits_128_plus_the_signal(capfd):
    """A rank killed by SIGKILL (the out-of-memory killer, say) prints nothing itself and its peers only see a
    broken connection: the launcher names it, stops the others, and the run exits 137 as a shell says it (it was
    247, ``sys.exit(-9)``)."""
    start = time.monotonic()
    code = launch_local(["-c", KILLED_RANK_1], 2)
    assert code == 137
    assert time.monotonic() - start < 10  # rank 0 (asleep) is stopped at once, not waited for
    err = capfd.readouterr().err
    assert err.count("rank 1 (pid ") == 1 and "was killed by SIGKILL" in err
