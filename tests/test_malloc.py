"""glibc's mmap threshold is pinned for streaming jobs: a freed large block goes back to the system instead of
staying in the heap (where, repeated, it makes a long retrieval's peak RSS creep up with the number of questions)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from dpr_gc.base.devices import steady_malloc

PROBE = """
import ctypes, sys
from dpr_gc.base.devices import steady_malloc
pinned = steady_malloc() if sys.argv[1] == "pin" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024
size = 8 << 20
block = libc.malloc(size)  # by default glibc raises its threshold when this (mmapped) block is freed ...
ctypes.memset(block, 1, size)
libc.free(block)
before = rss()  # ... so the next one comes from the heap and stays there once freed
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
print(pinned, rss() - before)
"""


def retained_bytes(mode: str, env: dict) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env,
                         timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is a glibc setting")
def test_freed_large_blocks_return_to_the_system_once_pinned():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    pinned, kept = retained_bytes("pin", env)
    assert pinned and kept < 1 << 20, f"{kept} B kept after freeing an 8 MiB block"
    unpinned, kept_by_default = retained_bytes("default", env)
    assert not unpinned and kept_by_default >= 4 << 20  # the behaviour the pin exists to avoid


def test_a_users_own_setting_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert steady_malloc() is False
