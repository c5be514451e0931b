"""A worker group whose ranks live on other nodes: how it fails when they do not come.

The happy path (a member node starting its ranks, tokens equal to the reference) runs with two
real node agents in tests/agents/node/test_cross_host.py; here the sites are plain objects, so
the group's own rules are tested without HTTP: a refusal, a rank nobody claims, a rank that
never connects - each an EngineError naming it, within the timeout, with no process left.
"""

from __future__ import annotations

import time

import pytest

from agents.engines.torch.engine import EngineError, TorchEngine
from agents.engines.torch.remote import Placement, RemoteStart
from tests.agents.engines.conftest import LAYOUTS, TinyModel, pid_alive


class Site:
    """A member that answers start_workers as told: raise, claim nothing, or claim without starting."""

    def __init__(self, name: str, *, refuse: str = "", claim: bool = False) -> None:
        self.name = name
        self.refuse = refuse
        self.claim = claim
        self.requests: list[RemoteStart] = []

    def start_workers(self, request: RemoteStart) -> list[tuple[int, int]]:
        self.requests.append(request)
        if self.refuse:
            raise RuntimeError(self.refuse)
        return list(request.ranks) if self.claim else []


def start(tiny_model: TinyModel, site: Site) -> None:
    TorchEngine(tiny_model.path, LAYOUTS["pp2"], timeout_s=3,
                placement={"main": Placement(frozenset({0}), (site,), "127.0.0.1")})


@pytest.mark.parametrize(("site", "message"), [
    (Site("z", refuse="weights: other weights"), r"node z did not start its ranks: weights: other weights"),
    (Site("z"), r"no node started rank\(s\) \[1\]"),
    (Site("z", claim=True), r"no connection within 3 s from rank\(s\) \[1\] \['flexpipe-main-s1t0@z'\]"),
])
def test_a_remote_rank_that_does_not_come_fails_the_group_naming_it(
        tiny_model: TinyModel, site: Site, message: str) -> None:
    before = set(_children())
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=message):
        start(tiny_model, site)
    assert time.monotonic() - t0 < 30
    (request,) = site.requests
    assert request.ranks == ((1, 0),) and len(request.authkey) == 32 and request.listener_addr[0] == "127.0.0.1"
    assert not [p for p in set(_children()) - before if pid_alive(p)]


def _children() -> list[int]:
    import multiprocessing

    return [int(p.pid) for p in multiprocessing.active_children() if p.pid is not None]
