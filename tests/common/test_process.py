"""A started process exempts its start-up objects from garbage collection, but not its garbage;
the worker's threads carry their names down to the OS."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.process import NamedThread

PROGRAM = """
import gc, weakref
from common.process import freeze_startup_objects

class Node:
    pass

kept = [Node() for _ in range(1000)]
garbage = Node()
garbage.self = garbage  # a cycle: only the collector frees it
dead = weakref.ref(garbage)
del garbage
gc.disable()  # no collection but the helper's own
freeze_startup_objects()
assert dead() is None, "the start-up's garbage was frozen, not freed"
assert gc.get_freeze_count() >= len(kept), gc.get_freeze_count()
assert not any(gc.get_objects(generation) for generation in (1, 2)), "objects left to scan"
"""


def test_start_up_objects_are_frozen_and_start_up_garbage_freed() -> None:
    # A process of its own: freezing the test process would change every later test's heap.
    subprocess.run([sys.executable, "-c", PROGRAM], check=True)


@pytest.mark.skipif(sys.platform != "linux", reason="OS thread names are set on Linux only")
def test_a_named_thread_shows_its_name_to_the_os() -> None:
    seen: list[str] = []

    def record() -> None:
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = NamedThread(target=record, name="spool-engine-and-more")
    thread.start()
    thread.join()
    assert seen == ["spool-engine-an"]  # the kernel keeps 15 bytes
