"""Graceful preemption: the first SIGTERM/SIGINT asks the loop to stop after the current step or evaluation;
a second exits.

The handler only sets a flag (safe at any point of the step); the training loop polls ``requested`` after
each optimizer step and after the evaluation at step 0, saves a checkpoint, flushes the metrics and exits
with status 128 + signal number (143 for SIGTERM, 130 for SIGINT), printing how to resume. A signal during
an evaluation lets that evaluation finish (its loss is logged) and no further step runs. A second signal
calls ``on_exit_now`` (the trainer records status "interrupted" in summary.json there) and then
``os._exit`` at once (no checkpoint; the previous one is intact thanks to the atomic save).

Under torchrun, Ctrl-C reaches every worker and torchrun then forwards a SIGTERM of its own; a second
signal within ``grace_s`` seconds of the first is therefore treated as the same request, not as "exit now".
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

HANDLED = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
    """Install with ``install()``, poll ``requested`` / ``signum``, restore with ``uninstall()``.

    Args:
        grace_s: a second signal closer than this to the first one is ignored (0 = none ignored).
        verbose: print a line when a signal arrives (rank 0 only in DDP).
        on_exit_now: called with the signal number just before a second signal exits the process (to
            record how the run ended); whatever it raises is printed and the process exits anyway.

    ``activity`` (default "step") names what the loop is doing, for the first signal's message; the loop
    sets it to "evaluation" while it evaluates.
    """

    def __init__(
        self, grace_s: float = 0.0, verbose: bool = True, on_exit_now: Callable[[int], None] | None = None
    ) -> None:
        self.signum: int | None = None
        self.grace_s = grace_s
        self.verbose = verbose
        self.on_exit_now = on_exit_now
        self.activity = "step"
        self._t_first = 0.0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """True once a first signal arrived."""
        return self.signum is not None

    def install(self) -> PreemptionHandler:
        """Take over SIGTERM and SIGINT (the previous handlers are kept for ``uninstall``); returns self."""
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Give SIGTERM and SIGINT back to the handlers that were there before ``install``."""
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
                    f"\n{name} received: finishing the current {self.activity}, then saving a checkpoint and "
                    f"exiting (send {name} again to exit at once without saving)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if time.monotonic() - self._t_first < self.grace_s:
            return
        print(f"\nsecond signal ({name}): exiting now without a checkpoint", file=sys.stderr, flush=True)
        if self.on_exit_now is not None:
            try:
                self.on_exit_now(signum)
            except BaseException as e:  # noqa: BLE001 - the user asked to exit now: never stay
                print(f"could not record the ending: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(128 + signum)
