"""The schedule threshold: set, read back, and the automatic choice from the world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import adasum


def small_message_limit(size: int) -> int:
    return adasum.current_settings().small_message_limit(size)


@pytest.fixture
def restore():
    before = adasum.get_small_message_bytes()
    yield
    adasum.set_small_message_bytes(before)


def test_automatic_threshold_shrinks_with_log_p(restore):
    adasum.set_small_message_bytes(None)
    assert adasum.get_small_message_bytes() is None
    mib = 1 << 20
    assert [small_message_limit(p) for p in (1, 2, 3)] == [3 * mib] * 3
    assert [small_message_limit(p) for p in (4, 5, 7)] == [mib] * 3
    assert [small_message_limit(p) for p in (8, 15, 16, 64)] == [mib // 2, mib // 2, mib // 3, mib // 5]


def test_a_set_threshold_holds_at_every_size(restore):
    adasum.set_small_message_bytes(4096)
    assert adasum.get_small_message_bytes() == 4096
    assert {small_message_limit(p) for p in (2, 8, 1024)} == {4096}
    with pytest.raises(ValueError, match=">= 0 bytes"):
        adasum.set_small_message_bytes(-5)
    assert adasum.get_small_message_bytes() == 4096


@pytest.mark.parametrize("text,want", [("auto", None), ("", None), ("0", 0), ("300000", 300000)])
def test_environment_sets_it_at_import(text, want):
    code = "import adasum; print(adasum.get_small_message_bytes())"
    env = dict(os.environ, ADASUM_SMALL_MESSAGE_BYTES=text)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == str(want)


@pytest.mark.parametrize("text,want", [("1", True), ("0", False)])
def test_cuda_aware_environment_is_read_at_import(text, want):
    code = "import adasum; print(adasum.cuda_aware_mpi(), adasum.current_settings().cuda_aware)"
    env = dict(os.environ, ADASUM_CUDA_AWARE=text)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.split() == [str(want), str(want)]
