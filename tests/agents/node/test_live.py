"""The daemon against a real console: live server over HTTP, a real Celery worker, real torch engines.

Nothing is called on the agent by hand: it enrolls, reports, long-polls; the console's gearbox
brings the tiny model's baseline up as a transition whose prepare_plan builds a torch plan on the
node; an operator's manual switch then moves a live sequence to a new plan on the other node.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from agents.node.daemon import NodeAgent
from agents.protocol import check_result
from console.celery import app
from console.fleet.models import AgentCommand, Gpu, Node
from console.gearbox.actions import do_pin_gear, do_request_gear, do_sync_deployment
from console.gearbox.models import Deployment, Transition
from scheduler.plan import Gear
from tests.agents.node.conftest import MODEL, gpus, tiny_plan
from tests.conftest import TEST_REDIS_URL

JOIN = "fpj_node-test"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def worker() -> Iterator[None]:
    redis.Redis.from_url(TEST_REDIS_URL).delete(app.conf.task_default_queue)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                      queues=[app.conf.task_default_queue]):
        yield


@pytest.fixture
def console(live_server: Any, settings: Any) -> str:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    settings.FLEXPIPE_REPORT_INTERVAL_S = 1.0
    settings.FLEXPIPE_PREPARE_TIMEOUT_S = 120.0
    settings.FLEXPIPE_STEP_TIMEOUT_S = 30.0
    settings.FLEXPIPE_MOVE_TIMEOUT_S = 30.0
    settings.FLEXPIPE_DRAIN_BUDGET_S = 2.0
    settings.FLEXPIPE_CANARY_DWELL_S = 0.2
    settings.FLEXPIPE_RETRY_BACKOFF_S = 0.2
    return str(live_server.url)


@pytest.fixture
def running(make_agent: Any, console: str) -> Iterator[Callable[..., NodeAgent]]:
    """Start agents on their own threads, as `python -m agents.node` runs them; stopped after."""
    threads: list[tuple[NodeAgent, threading.Thread]] = []

    def start(node_id: str, **kwargs: Any) -> NodeAgent:
        agent = make_agent(node_id, controller=console, token=JOIN, long_poll_s=1.0, **kwargs)
        t = threading.Thread(target=agent.run, name=f"agent-{node_id}", daemon=True)
        t.start()
        threads.append((agent, t))
        return agent

    yield start
    for agent, t in threads:
        agent.stop()
        t.join(timeout=10)


def wait_for(cond: Callable[[], object], max_s: float, what: str, story: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + max_s
    last_sweep = 0.0
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {max_s} s. {story()}"
        if time.monotonic() - last_sweep > 1.0:  # what beat's sweep does
            app.send_task("transitions.sweep", queue=app.conf.task_default_queue)
            last_sweep = time.monotonic()
        time.sleep(0.1)


def story() -> str:
    return "; ".join(f"#{t.seq} {t.kind} {t.phase}/{t.step} {t.error[:120]}" for t in Transition.objects.order_by("id")) \
        + " | commands: " + "; ".join(f"{c.node.node_id} {c.kind} {c.state} {c.detail[:100]}"
                                      for c in AgentCommand.objects.select_related("node").order_by("id"))


def test_it_enrolls_with_its_own_token_and_reports_its_gpus(running: Callable[..., NodeAgent]) -> None:
    agent = running("n1")
    wait_for(lambda: Gpu.objects.filter(node__node_id="n1").exclude(updated_at=None).count() == 2, 20, "a report")
    node = Node.objects.get(node_id="n1")
    assert node.backends == ["torch"] and node.data_addr == agent.data_addr
    assert agent.client.token != JOIN
    assert set(Gpu.objects.filter(node=node).values_list("uuid", flat=True)) == set(gpus("n1"))


def test_the_gearbox_prepares_a_torch_plan_and_a_manual_switch_moves_it(running: Callable[..., NodeAgent],
                                                                        worker: None) -> None:
    pytest.importorskip("agents.dataplane")
    baseline = Gear(MODEL, (tiny_plan([gpus("n1", 1)]),), (1.0,))
    do_sync_deployment(name="tiny", model_name=MODEL, ttft_ms=2000, tpot_ms=200, priority=1, baseline=baseline,
                       actor="system:test")
    n1, n2 = running("n1"), running("n2")
    wait_for(lambda: Deployment.objects.get(name="tiny").current_gear, 120, "the baseline up", story)
    dep = Deployment.objects.get(name="tiny")
    assert Gear.from_dict(dep.current_gear).gear_id == baseline.gear_id
    slot = n1.plans[("tiny", baseline.plans[0].plan_id)]
    assert slot.engine is not None and slot.role == "leader" and not n2.plans
    for c in AgentCommand.objects.filter(state="ok"):
        check_result(c.kind, c.result)
    do_pin_gear("tiny", actor="system:test")  # only the operator moves it from here

    target = Gear(MODEL, (tiny_plan([gpus("n2", 1)]),), (1.0,))
    _, started = do_request_gear("tiny", target, actor="system:test", reason="move to n2")
    assert started is not None, story()
    wait_for(lambda: Transition.objects.get(deployment__name="tiny", seq=started.seq).phase == "done", 120,
             "the switch", story)
    assert ("tiny", target.plans[0].plan_id) in n2.plans and ("tiny", baseline.plans[0].plan_id) not in n1.plans
    for c in AgentCommand.objects.filter(state="ok"):
        check_result(c.kind, c.result)
