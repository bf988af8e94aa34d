"""The allocator settings are applied on glibc Linux and can be switched off."""

import sys

import pytest

from omgrpo import allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_memory_applies_on_linux_and_is_switched_off_by_env(monkeypatch):
    assert allocator.keep_freed_memory() is True
    monkeypatch.setenv(allocator.DISABLE_ENV, "0")
    assert allocator.keep_freed_memory() is False
