"""The store's executor: a waiter runs its own unstarted task; everything runs once."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, TimeoutError, wait

import pytest

from kvtier.store.executor import StealingExecutor


def _blocked_pool() -> tuple[StealingExecutor, threading.Event]:
    """One I/O thread, held busy until the returned event is set."""
    ex = StealingExecutor(1, "test-io")
    gate = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(10)

    ex.submit(hold)
    assert started.wait(10)
    return ex, gate


def test_a_waiter_runs_its_task_itself_when_no_thread_has_begun_it() -> None:
    ex, gate = _blocked_pool()
    try:
        fut = ex.submit(lambda: threading.current_thread().name)
        assert fut.result() == threading.current_thread().name
    finally:
        gate.set()
        ex.shutdown()


def test_a_task_nobody_waits_for_runs_on_an_io_thread() -> None:
    ex = StealingExecutor(1, "test-io")
    try:
        fut = ex.submit(lambda: threading.current_thread().name)
        done, _ = wait([fut], timeout=10)  # a waiter that does not call result()
        assert done
        assert fut.result().startswith("test-io")
    finally:
        ex.shutdown()


def test_a_result_with_a_timeout_never_takes_the_task() -> None:
    ex, gate = _blocked_pool()
    try:
        fut = ex.submit(lambda: threading.current_thread().name)
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.05)
        gate.set()
        assert fut.result(timeout=10).startswith("test-io")
    finally:
        gate.set()
        ex.shutdown()


def test_errors_reach_the_waiter_as_from_a_pool() -> None:
    ex, gate = _blocked_pool()
    try:

        def boom() -> None:
            raise ValueError("bad bytes")

        fut = ex.submit(boom)
        assert isinstance(fut.exception(), ValueError)
        with pytest.raises(ValueError, match="bad bytes"):
            fut.result()
    finally:
        gate.set()
        ex.shutdown()


def test_a_cancelled_task_never_runs() -> None:
    ex, gate = _blocked_pool()
    ran: list[int] = []
    try:
        fut = ex.submit(ran.append, 1)
        assert fut.cancel()
        with pytest.raises(CancelledError):
            fut.result()
    finally:
        gate.set()
        ex.shutdown()
    assert ran == []


def test_every_task_runs_exactly_once_under_racing_waiters() -> None:
    ex = StealingExecutor(4, "test-io")
    counts = [0] * 2000
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            counts[i] += 1
        return i

    futs = [ex.submit(work, i) for i in range(len(counts))]
    results: list[int] = []

    def waiter(part: int) -> None:
        got = [f.result() for f in futs[part::3]]
        with lock:
            results.extend(got)

    threads = [threading.Thread(target=waiter, args=(p,)) for p in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ex.shutdown()
    assert counts == [1] * len(counts)
    assert sorted(results) == list(range(len(counts)))
