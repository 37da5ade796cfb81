"""Short GIL turns while background Python runs beside the training thread.

CPython hands the GIL to a thread that waits for it only after the switch interval (5 ms
by default) has passed. A thread that waits outside the GIL for a little while (a CUDA
event, a copy to the host, a queue, a file write) finds it taken on its return whenever
another thread has Python to run, and then waits that whole interval. An async
checkpoint's threads run Python for a few hundred ms after each save (copying the state
dict, planning, pickling the plans, serializing each tensor): on an H100 the step right
after each save took 333-587 ms instead of 23 ms. A model of the pattern on the CPU (a
2.4 ms step with six short waits, beside a busy Python thread) takes 35.7 ms with 5 ms
turns, 9.1 ms with 1 ms turns and 4.3 ms with 0.5 ms turns. A compiled step lets go of the
GIL at every kernel launch (about 600 for GPT-2 124M): with 0.5 ms turns its step after a
save still took 352-507 ms on an H100, hence 0.1 ms. On 2 CPU cores a gpt-mini step during
a background save ran 1.37-1.49x one without, against 1.40-1.86x with 0.5 ms turns.

``SHORT_TURNS`` lowers the interval to ``BACKGROUND_SWITCH_INTERVAL_S`` while any holder
is in, and gives back the one before when the last leaves. The interval is the process's,
so ``SHORT_TURNS`` is the one object that counts the holders; an interval someone else set
meanwhile is left as they set it.
"""

from __future__ import annotations

import logging
import sys
import threading

BACKGROUND_SWITCH_INTERVAL_S = 0.0001
_SAME_INTERVAL_S = 1e-6  # CPython keeps the interval in whole microseconds

log = logging.getLogger(__name__)


class ShortTurns:
    """Counts the holders of short GIL turns; the first in shortens them, the last out
    restores the interval it found (never lengthens one already shorter)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._previous = sys.getswitchinterval()
        self._set = self._previous  # the interval ``enter`` set

    def enter(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._previous = sys.getswitchinterval()
                sys.setswitchinterval(min(self._previous, BACKGROUND_SWITCH_INTERVAL_S))
                self._set = sys.getswitchinterval()
            self._holders += 1

    def leave(self) -> None:
        with self._lock:
            if self._holders == 0:
                log.debug("short GIL turns left more often than entered", stack_info=True)
                return
            self._holders -= 1
            if self._holders == 0 and abs(sys.getswitchinterval() - self._set) < _SAME_INTERVAL_S:
                sys.setswitchinterval(self._previous)


SHORT_TURNS = ShortTurns()
