"""A real 3-member etcd cluster on 127.0.0.1 for each test that asks for one. Without an
``etcd`` on PATH the tests skip, unless CHAMELEON_REQUIRE_ETCD is set (.ci/run sets it:
scripts/install.sh installs Debian's etcd-server there, and a missing server must fail)."""

from __future__ import annotations

import os

import pytest

from tests.etcd.cluster import etcd_binary, start_cluster


@pytest.fixture
def etcd(tmp_path):
    if etcd_binary() is None:
        if os.environ.get("CHAMELEON_REQUIRE_ETCD"):
            pytest.fail("no etcd on PATH (scripts/install.sh installs Debian's etcd-server)")
        pytest.skip("no etcd on PATH (scripts/install.sh installs Debian's etcd-server)")
    cluster = start_cluster(tmp_path / "etcd")
    yield cluster
    cluster.stop()
