"""Nodes in network namespaces (tests/netns.py). Where namespaces cannot be made (no root,
no ``ip``) the tests skip, unless CHAMELEON_REQUIRE_NETNS is set (.ci/run sets it where
its probe can make one, so that a broken set-up fails instead of skipping)."""

from __future__ import annotations

import os

import pytest

from tests.netns import Net, unavailable


@pytest.fixture
def net():
    why = unavailable()
    if why is not None:
        if os.environ.get("CHAMELEON_REQUIRE_NETNS"):
            pytest.fail(why)
        pytest.skip(why)
    made: list[Net] = []

    def make(nodes: int) -> Net:
        made.append(Net(nodes))
        return made[-1]

    yield make
    for n in made:
        n.close()
