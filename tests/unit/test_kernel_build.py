"""How the kernels' build is cached: one build per kind of machine, and a killed build's lock does not block forever."""

import os
import time
from unittest import mock

from liteinfer import kernels


def test_build_tag_follows_the_cpu_python_and_torch():
    tag = kernels.build_tag()
    assert tag == kernels.build_tag() and len(tag) == 12
    with mock.patch.object(kernels.platform, "processor", return_value="another CPU"):
        assert kernels.build_tag() != tag
    with mock.patch.object(kernels.torch, "__version__", "0.0.0"):
        assert kernels.build_tag() != tag


def test_build_tag_follows_the_headers_the_sources_include(tmp_path):
    """torch's builder hashes the .cpp files it compiles, not the headers they include."""
    header = tmp_path / "shared.h"
    header.write_text("inline int f() { return 1; }")
    with mock.patch.object(kernels, "source_files", return_value=[tmp_path / "op.cpp", header]):
        tag = kernels.build_tag()
        header.write_text("inline int f() { return 2; }")
        assert kernels.build_tag() != tag


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    kernels.remove_stale_lock(tmp_path)  # a build may be running right now
    assert lock.exists()
    left_at = time.time() - kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (left_at, left_at))
    kernels.remove_stale_lock(tmp_path)
    assert not lock.exists()
    kernels.remove_stale_lock(tmp_path)  # no lock: nothing to do
