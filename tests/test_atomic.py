"""Atomic outputs: nothing visible until complete, normal permissions, no leftovers on failure."""

import os
import stat

import pytest

from snakellm.io import atomic as atomic


def test_outputs_get_umask_permissions_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic.write_text(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == 0o644


def test_group_publishes_all_or_nothing(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with pytest.raises(RuntimeError):
        with atomic.atomic_group(a, b) as (ta, tb):
            ta.write_text("1")
            raise RuntimeError("killed half way")
    assert list(tmp_path.iterdir()) == []
    with atomic.atomic_group(a, b) as (ta, tb):
        ta.write_text("1")
        tb.write_text("2")
        assert not a.exists() and not b.exists()
    assert a.read_text() == "1" and b.read_text() == "2"
