"""The daemon's reused value buffers: a buffer is lent again only once nothing can reach it."""

from __future__ import annotations

import gc
import platform

import numpy as np
import pytest

from kvtier.service import malloc
from kvtier.service.buffers import ValueBuffers


def test_a_released_buffer_is_lent_again_without_a_new_map() -> None:
    pool = ValueBuffers(1 << 20)
    a = pool.take()
    a[:] = 7
    del a
    b = pool.take(4096)
    assert pool.created == 1
    assert b.nbytes == 4096 and b.flags.writeable
    assert (b == 7).all()  # the same memory: what the earlier loan wrote


def test_a_buffer_is_not_lent_while_a_view_of_it_lives() -> None:
    pool = ValueBuffers(1 << 16)
    a = pool.take()
    a[:] = 1
    views = [a.data[:100], a[10:20], np.frombuffer(a.data[5:50], dtype=np.uint8)]
    del a
    gc.collect()
    b = pool.take()
    b[:] = 2  # must not be the memory the views see
    assert pool.created == 2
    assert all((np.asarray(v) == 1).all() for v in views)
    del views
    gc.collect()
    assert pool.idle() == 1


def test_idle_buffers_are_bounded() -> None:
    pool = ValueBuffers(1 << 20, idle_bytes=2 << 20)
    held = [pool.take() for _ in range(5)]
    del held
    assert pool.idle() == 2 and pool.created == 5


def test_beyond_the_pool_size_a_plain_array() -> None:
    pool = ValueBuffers(4096)
    big = pool.take(8192)
    assert big.nbytes == 8192 and pool.created == 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_daemon_can_fix_glibcs_thresholds() -> None:
    # Served in-process by `kvtier serve` at start-up (service/server.py).
    assert malloc.tune()


def test_the_default_keeps_64_mib_idle_and_at_least_one_buffer() -> None:
    # docs/operations.md states these figures.
    assert ValueBuffers(32 << 20).keep == 2
    assert ValueBuffers(1 << 20).keep == 64
    assert ValueBuffers(256 << 20).keep == 1
