"""The store's executor: a waiter runs its own unstarted task; everything runs once.

Every test runs over both queues: the C one (:class:`kvtier._speedups.WorkQueue`, skipped
with a reason where the speedups are not built) and the thread-pool fallback.
"""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError, TimeoutError, wait

import pytest

from kvtier.store.executor import StealingExecutor

try:
    from kvtier._speedups import WorkQueue  # noqa: F401
except ImportError:
    _NO_C = True
else:
    _NO_C = False


@pytest.fixture(
    params=[
        pytest.param(True, id="c-queue", marks=pytest.mark.skipif(_NO_C, reason="no C speedups")),
        pytest.param(False, id="thread-pool"),
    ]
)
def speedups(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _pool(threads: int, speedups: bool) -> StealingExecutor:
    ex = StealingExecutor(threads, "test-io", speedups=speedups)
    assert ex.speedups is speedups
    return ex


def _blocked_pool(speedups: bool) -> tuple[StealingExecutor, threading.Event]:
    """One I/O thread, held busy until the returned event is set."""
    ex = _pool(1, speedups)
    gate = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(10)

    ex.submit(hold)
    assert started.wait(10)
    return ex, gate


def test_a_waiter_runs_its_task_itself_when_no_thread_has_begun_it(speedups: bool) -> None:
    ex, gate = _blocked_pool(speedups)
    try:
        fut = ex.submit(lambda: threading.current_thread().name)
        assert fut.result() == threading.current_thread().name
    finally:
        gate.set()
        ex.shutdown()


def test_a_task_nobody_waits_for_runs_on_an_io_thread(speedups: bool) -> None:
    ex = _pool(1, speedups)
    try:
        fut = ex.submit(lambda: threading.current_thread().name)
        done, _ = wait([fut], timeout=10)  # a waiter that does not call result()
        assert done
        assert fut.result().startswith("test-io")
    finally:
        ex.shutdown()


def test_a_result_with_a_timeout_never_takes_the_task(speedups: bool) -> None:
    ex, gate = _blocked_pool(speedups)
    try:
        fut = ex.submit(lambda: threading.current_thread().name)
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.05)
        gate.set()
        assert fut.result(timeout=10).startswith("test-io")
    finally:
        gate.set()
        ex.shutdown()


def test_errors_reach_the_waiter_as_from_a_pool(speedups: bool) -> None:
    ex, gate = _blocked_pool(speedups)
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


def test_a_cancelled_task_never_runs(speedups: bool) -> None:
    ex, gate = _blocked_pool(speedups)
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


def test_every_task_runs_exactly_once_under_racing_waiters(speedups: bool) -> None:
    ex = _pool(4, speedups)
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


def test_a_task_with_a_callback_runs_on_an_io_thread(speedups: bool) -> None:
    ex = _pool(1, speedups)
    try:
        names: list[str] = []
        done = threading.Event()
        fut = ex.submit(lambda: threading.current_thread().name)

        def react(f: Future[str]) -> None:
            names.append(f.result())
            done.set()

        fut.add_done_callback(react)
        assert done.wait(10)
        assert names[0].startswith("test-io")
    finally:
        ex.shutdown()


def test_shutdown_finishes_queued_work_then_refuses_more(speedups: bool) -> None:
    ex, gate = _blocked_pool(speedups)
    ran: list[int] = []
    futs = [ex.submit(ran.append, i) for i in range(20)]
    gate.set()
    ex.shutdown(wait=True)
    assert sorted(ran) == list(range(20))
    assert all(f.done() for f in futs)
    with pytest.raises(RuntimeError):
        ex.submit(ran.append, 99)


def test_an_executor_dropped_without_shutdown_stops_its_threads(speedups: bool) -> None:
    before = {t.ident for t in threading.enumerate()}
    ex = _pool(2, speedups)
    assert ex.submit(lambda: 1).result() == 1
    ex.submit(lambda: 2)  # queued, nobody waits: it still runs before the threads stop
    mine = [
        t for t in threading.enumerate() if t.ident not in before and t.name.startswith("test-io")
    ]
    del ex
    gc.collect()
    for t in mine:
        t.join(10)
        assert not t.is_alive()


@pytest.mark.skipif(_NO_C, reason="no C speedups")
def test_the_c_queue_hands_each_task_out_once() -> None:
    from kvtier._speedups import WorkQueue

    q = WorkQueue(0.0)
    a, b, c = object(), object(), object()
    for task in (a, b, c):
        q.put(task)
    assert q.take(b) is True
    assert q.take(b) is False  # already taken
    assert q.pending() == 2
    assert q.get() is a
    assert q.take(a) is False  # a worker has it
    q.close()
    assert q.get() is c  # closed: what is queued still goes out
    assert q.get() is None
    with pytest.raises(RuntimeError):
        q.put(a)


def test_tasks_queued_together_run_on_every_thread_while_the_workers_linger(
    speedups: bool,
) -> None:
    # A put does not wake a worker while another waits timed (it lingers after recent
    # work, so a caller that takes its task back costs no wake-up); the worker that
    # takes a task must then wake the next for the rest. Four tasks that meet at a
    # barrier only finish if four threads run them at once; nobody waits for them.
    ex = _pool(4, speedups)
    try:
        for _ in range(20):
            for i in range(50):  # waited-for work just before: the workers linger
                assert ex.submit(int, str(i)).result() == i
            barrier = threading.Barrier(4)
            futs = [ex.submit(barrier.wait, 10) for _ in range(4)]
            done, _ = wait(futs, timeout=30)
            assert len(done) == 4 and all(f.exception() is None for f in futs)
    finally:
        ex.shutdown()


@pytest.mark.skipif(_NO_C, reason="no C speedups")
def test_the_c_queue_rejects_a_bad_grace() -> None:
    from kvtier._speedups import WorkQueue

    with pytest.raises(ValueError, match="grace"):
        WorkQueue(-1.0)
    with pytest.raises(TypeError):
        WorkQueue("soon")


def test_the_inline_executors_finished_future_works_as_any_future() -> None:
    # Born finished, sharing one condition: every Future method a caller may use.
    import asyncio

    from kvtier.store.executor import INLINE, Finished

    seen: list[Future[int]] = []
    ok = INLINE.submit(lambda x: x + 1, 41, on_done=seen.append)
    assert isinstance(ok, Future) and isinstance(ok, Finished) and seen == [ok]
    assert ok.done() and not ok.running() and not ok.cancelled() and not ok.cancel()
    assert ok.result() == 42 and ok.result(timeout=0) == 42 and ok.exception() is None
    calls: list[Future[int]] = []
    ok.add_done_callback(calls.append)  # called at once, as for any finished future
    assert calls == [ok]
    with pytest.raises(InvalidStateError):  # finished, as after set_result
        ok.set_result(0)

    def boom() -> int:
        raise ValueError("boom")

    bad = INLINE.submit(boom)
    assert isinstance(bad.exception(), ValueError)
    with pytest.raises(ValueError, match="boom"):
        bad.result()
    done, pending = wait([ok, bad, Future()], timeout=0)
    assert done == {ok, bad} and len(pending) == 1

    async def awaited() -> int:
        return await asyncio.wrap_future(ok)

    assert asyncio.run(awaited()) == 42
    # Futures from other threads at the same time: the shared condition never blocks.
    out: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: out.extend(INLINE.submit(int, "7").result() for _ in range(500))
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [7] * 2000


def _racing_round(ex: StealingExecutor, i: int) -> None:
    running = threading.Event()

    def work() -> int:
        running.set()
        time.sleep((0, 0.001, 0.02)[i % 3])  # the others arrive after the run, or during it
        if i % 7 == 0:
            raise ValueError(f"task {i}")
        return i

    fut = ex.submit(work)
    calls: list[int] = []
    got: list[object] = []
    seen: list[bool] = []

    def other(kind: int) -> None:
        running.wait(5)
        if kind == 0:
            got.append(fut.exception(timeout=10) or fut.result(timeout=10))
        elif kind == 1:
            fut.add_done_callback(lambda _f: calls.append(1))
        else:
            seen.append(fut.cancel())  # running or finished: False
            done, _ = wait([fut], timeout=10)
            seen.append(fut in done)

    others = [threading.Thread(target=other, args=(k,)) for k in (0, 1, 2)]
    for t in others:
        t.start()
    if i % 2:
        time.sleep(0.002)  # past the grace: a free I/O thread runs it
    if i % 7 == 0:
        with pytest.raises(ValueError, match=f"task {i}"):
            fut.result()
    else:
        assert fut.result() == i
    for t in others:
        t.join(10)
    assert not any(t.is_alive() for t in others)
    assert calls == [1]
    assert seen == [False, True]  # the cancel failed, the wait saw it done
    assert len(got) == 1
    assert isinstance(got[0], ValueError) if i % 7 == 0 else got[0] == i


def test_threads_that_wait_cancel_or_add_callbacks_while_a_task_runs_all_see_its_end(
    speedups: bool,
) -> None:
    # A task makes its condition only when another thread needs it: whichever comes
    # first, the thread running it (the waiter itself or an I/O thread) or one that
    # starts waiting mid-run, nobody misses the end, every callback runs once, and a
    # cancel mid-run fails as for any future.
    free = _pool(2, speedups)
    held, gate = _blocked_pool(speedups)  # its one thread busy: the waiter runs the task
    try:
        for i in range(120):
            _racing_round(free if i % 2 else held, i)
    finally:
        gate.set()
        free.shutdown()
        held.shutdown()


def test_a_waiter_that_runs_its_task_raises_its_error_and_keeps_no_cycle(speedups: bool) -> None:
    ex, gate = _blocked_pool(speedups)
    try:

        def boom() -> int:
            raise KeyError("gone")

        fut = ex.submit(boom)
        with pytest.raises(KeyError):
            fut.result()  # run here, on this thread: the quiet path
        assert isinstance(fut.exception(), KeyError) and fut.done()
        with pytest.raises(KeyError):
            fut.result()  # again, as Future does
    finally:
        gate.set()
        ex.shutdown()
