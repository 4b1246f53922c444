"""Graceful preemption: the first SIGTERM/SIGINT asks the loop to stop after the current step or
evaluation (checkpoint, exit 128 + signal); a second exits at once. Under torchrun a second signal within
``grace_s`` of the first is the same request (torchrun forwards Ctrl-C as its own SIGTERM)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

HANDLED = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
    """Install with ``install()``, poll ``signum`` (None until a signal), restore with ``uninstall()``."""

    def __init__(
        self, grace_s: float = 0.0, verbose: bool = True, on_exit_now: Callable[[int], None] | None = None
    ) -> None:
        self.signum: int | None = None
        self.grace_s, self.verbose, self.on_exit_now = grace_s, verbose, on_exit_now
        self.activity, self._t_first = "step", 0.0
        self._previous: dict[int, object] = {}

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
