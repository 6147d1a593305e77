"""`mha-serve` with a gate in its engine, for tests that need a call held in flight: a batch
holding a sequence of GATE_LEN tokens makes the compute thread touch `entered` in the
directory $MHA_TEST_GATE_DIR, then wait there until the test creates `open`. Run as
`python -m tests.reliability.gated_serve <mha-serve flags>` with --inline-lone-requests
false (an inline call would hold the event loop, signals and all, not the compute thread)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

GATE_ENV = "MHA_TEST_GATE_DIR"
GATE_LEN = 13  # tokens of the held call (the warm-up's are 4)
POLL_S = 0.01


def main() -> int:
    gate = Path(os.environ[GATE_ENV])
    from mha_serve.engine import Engine  # (torch, in the engine process only)
    from mha_serve.transport.main import main as serve

    run_batch = Engine.run_batch

    def gated(self, hosted, batch):
        if any(p.inputs.shape[1] == GATE_LEN for p in batch):
            (gate / "entered").touch()
            while not (gate / "open").exists():
                time.sleep(POLL_S)
        return run_batch(self, hosted, batch)

    Engine.run_batch = gated
    return serve(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
