"""/metrics with frontend workers (metrics/exposition.py): the process tree's figures.
process_cpu_seconds_total is a counter: a process of the tree that exits (a frontend that
dies and is started again) keeps its CPU seconds in the total, over a real child process."""

from __future__ import annotations

import subprocess
import sys

from mha_serve.metrics import ProcessTree

CHILD_CPU_S = 0.5  # burnt by the child, as its own CPU time says (no wall-clock)
# /proc counts CPU in clock ticks, process_time() finer: the child shows at least this much.
SEEN_CPU_S = CHILD_CPU_S - 0.1
# A child that burns CHILD_CPU_S of CPU, says so, and exits once its stdin closes (the gate).
BURN = """
import sys, time
while time.process_time() < float(sys.argv[1]):
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def cpu_seconds(tree: ProcessTree) -> float:
    for family in tree.collect():
        if family.name == "process_cpu_seconds":
            return family.samples[0].value
    raise AssertionError("no process_cpu_seconds_total collected")


def test_a_child_that_exits_keeps_its_cpu_seconds_in_the_total():
    child = subprocess.Popen(
        [sys.executable, "-c", BURN, str(CHILD_CPU_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    live = [child.pid]
    tree = ProcessTree(lambda: list(live))  # what the engine process reports
    try:
        assert child.stdout.readline() == "burnt\n"
        alone = cpu_seconds(ProcessTree(list))  # this process and its children gone before
        with_child = cpu_seconds(tree)
        assert with_child >= alone + SEEN_CPU_S
    finally:
        child.stdin.close()
        child.wait()  # reaped, as the engine process joins a frontend that died
        child.stdout.close()
    live.clear()  # (gone from the frontends the engine lists)
    after = cpu_seconds(tree)
    print(f"\nCPU seconds: {alone:.2f} alone, {with_child:.2f} with the child, {after:.2f} after")
    assert after >= with_child  # a counter: it never goes down
    assert after >= alone + SEEN_CPU_S  # the child's seconds are still in it
