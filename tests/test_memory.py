"""Freed heap memory goes back to the operating system: at once, and once a minute in every process of a
peer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cotrain import memory

pytestmark = pytest.mark.skipif(memory._malloc_trim() is None, reason="needs glibc's malloc_trim")

# 200 MiB of heap blocks (below glibc's mmap threshold) freed, except the last, which pins the heap's top: the
# freed pages stay with the process until something trims them
HOLD_PEAK = """
import os
def rss_mib():
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
blocks = [bytearray(100_000) for _ in range(2000)]
pin = blocks.pop()
del blocks
"""


def run(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HOLD_PEAK) + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_release_free_memory_hands_a_freed_peak_back():
    held, trimmed = map(
        float,
        run(
            """
            from cotrain.memory import release_free_memory
            held = rss_mib()
            assert release_free_memory()
            print(held, rss_mib())
            """
        ),
    )
    assert held > 150, held  # the freed peak is still held
    assert trimmed < held - 150, (held, trimmed)  # and trimming gave it back


def test_forked_children_trim_their_own_heap():
    # the child is forked the way hivemind forks its DHT and averager processes
    child_rss, threads = run(
        """
        import multiprocessing as mp, threading, time
        from cotrain.memory import keep_heap_trimmed
        del pin
        keep_heap_trimmed(every=0.3)

        def child(queue):
            blocks = [bytearray(100_000) for _ in range(2000)]
            pin = blocks.pop()
            del blocks
            time.sleep(1.5)
            queue.put((rss_mib(), [t.name for t in threading.enumerate()]))

        queue = mp.get_context("fork").Queue()
        proc = mp.get_context("fork").Process(target=child, args=(queue,))
        proc.start()
        rss, names = queue.get(timeout=30)
        proc.join()
        print(rss, names.count("cotrain-trim"))
        """
    )
    assert int(threads) == 1
    assert float(child_rss) < 120, child_rss  # the child's 200 MiB peak went back without it asking


def test_keep_heap_trimmed_starts_one_thread_per_process():
    (count,) = run(
        """
        import threading
        from cotrain.memory import keep_heap_trimmed
        keep_heap_trimmed()
        keep_heap_trimmed()
        print(sum(t.name == "cotrain-trim" for t in threading.enumerate()))
        """
    )
    assert count == "1"
