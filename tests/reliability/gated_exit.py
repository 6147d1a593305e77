"""`mha-serve` held as it exits, for tests of a signal that comes then. The process stops
twice in the directory $MHA_TEST_EXIT_GATE_DIR: once its event loop has ended (the server
stopped, the loop's signal handlers gone with it) it touches `closed` and waits until the
test creates `open-closed`; once mha-serve's main() has returned (what follows is the
interpreter's end) it touches `returned` and waits for `open-returned`; then it exits with
main()'s code. Run as `python -m tests.reliability.gated_exit <mha-serve flags>` (the
engine process is held; frontend workers, started fresh, are not)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

EXIT_GATE_ENV = "MHA_TEST_EXIT_GATE_DIR"
POINTS = ("closed", "returned")
POLL_S = 0.01


def hold(gate: Path, point: str) -> None:
    (gate / point).touch()
    while not (gate / f"open-{point}").exists():
        time.sleep(POLL_S)


def main() -> int:
    gate = Path(os.environ[EXIT_GATE_ENV])
    from mha_serve.transport import busy_poll
    from mha_serve.transport.main import main as serve

    run = busy_poll.run

    def gated(coroutine, busy_poll_us: int = 0):
        try:
            return run(coroutine, busy_poll_us)  # (its loop closed when it returns)
        finally:
            hold(gate, "closed")

    busy_poll.run = gated
    code = serve(sys.argv[1:])
    hold(gate, "returned")
    return code


if __name__ == "__main__":
    sys.exit(main())
