"""Graceful preemption: the first SIGTERM/SIGINT asks the loop to stop after the current step; a second exits.

The handler only sets a flag (safe at any point of the step); the training loop polls ``requested`` after
each optimizer step, saves a checkpoint, flushes the metrics and exits with status 128 + signal number
(143 for SIGTERM, 130 for SIGINT), printing how to resume. A second signal calls ``os._exit`` at once
(no checkpoint; the previous one is intact thanks to the atomic save).

Under torchrun, Ctrl-C reaches every worker and torchrun then forwards a SIGTERM of its own; a second
signal within ``grace_s`` seconds of the first is therefore treated as the same request, not as "exit now".
"""

from __future__ import annotations

import os
import signal
import sys
import time

HANDLED = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
    """Install with ``install()``, poll ``requested`` / ``signum``, restore with ``uninstall()``.

    Args:
        grace_s: a second signal closer than this to the first one is ignored (0 = none ignored).
        verbose: print a line when a signal arrives (rank 0 only in DDP).
    """

    def __init__(self, grace_s: float = 0.0, verbose: bool = True) -> None:
        self.signum: int | None = None
        self.grace_s = grace_s
        self.verbose = verbose
        self._t_first = 0.0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """True once a first signal arrived."""
        return self.signum is not None

    def install(self) -> PreemptionHandler:
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            self._t_first = time.monotonic()
            if self.verbose:
                print(
                    f"\n{name} received: finishing the current step, then saving a checkpoint and exiting "
                    f"(send {name} again to exit at once without saving)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if time.monotonic() - self._t_first < self.grace_s:
            return
        print(f"\nsecond signal ({name}): exiting now without a checkpoint", file=sys.stderr, flush=True)
        os._exit(128 + signum)
