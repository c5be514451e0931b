"""Issue 19: a report writes what it changed, and agents send delta reports (agents/protocol/)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from agents.client import AgentClient
from agents.protocol import GpuInfo, GpuReport, RegisterRequest, Report
from console.fleet.models import Gpu, GpuSample, Node
from tests.builders import GIB, JOIN_TOKEN, report_body
from tests.console.conftest import enroll

pytestmark = pytest.mark.django_db


def _writes(ctx: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith(("INSERT", "UPDATE"))]


class TestWritesFollowTheChange:
    def one_changed(self, client: Client, node_id: str, gpus: int) -> tuple[int, list[str], set[str]]:
        agent = enroll(client, node_id, gpus=gpus)
        assert agent.post("/agent/v1/report", report_body(node_id, seq=1, gpus=gpus)).status_code == 200
        before = dict(Gpu.objects.filter(node__node_id=node_id).values_list("uuid", "updated_at"))
        samples = GpuSample.objects.count()
        body = report_body(node_id, seq=2, gpus=gpus)
        body["gpus"][3]["mem_used_bytes"] = 33 * GIB
        with CaptureQueriesContext(connection) as ctx:
            assert agent.post("/agent/v1/report", body).status_code == 200
        after = dict(Gpu.objects.filter(node__node_id=node_id).values_list("uuid", "updated_at"))
        return GpuSample.objects.count() - samples, _writes(ctx), {u for u in after if after[u] != before[u]}

    def test_a_report_of_one_changed_gpu_writes_that_gpu_and_one_sample_whatever_the_node_size(
            self, client: Client) -> None:
        small = self.one_changed(client, "s1", 8)
        big = self.one_changed(client, "b1", 64)
        assert small[0] == big[0] == 1  # one history sample: the changed GPU's
        assert small[2] == {"GPU-s1-3"} and big[2] == {"GPU-b1-3"}
        assert len(small[1]) == len(big[1])  # the same statements for 8 GPUs as for 64: O(the change)
        node = Node.objects.get(node_id="b1")
        assert node.reported_at is not None and node.prev_reported_at is not None
        assert Gpu.objects.get(uuid="GPU-b1-3").mem_used_bytes == 33 * GIB

    def test_a_report_from_a_token_the_process_knows_reads_its_node_once_with_its_gpus(
            self, client: Client) -> None:
        agent = enroll(client, "q1", gpus=8)
        assert agent.post("/agent/v1/report", report_body("q1", seq=1, gpus=8)).status_code == 200
        body = report_body("q1", seq=2, gpus=8)
        body["gpus"][5]["sm_util"] = 0.9
        body["plans"] = []
        with CaptureQueriesContext(connection) as ctx:
            assert agent.post("/agent/v1/report", body).status_code == 200
        sql = [q["sql"] for q in ctx.captured_queries]
        reads = [q for q in sql if q.lstrip().upper().startswith("SELECT")]
        # the node's row rides on its GPUs' (no lookup by token), and the plans' check reads only the routing
        assert len(reads) == 2, reads
        assert '"fleet_gpu"' in reads[0] and '"fleet_node"' in reads[0] and '"token_hash"' in reads[0]
        assert '"gearbox_deployment"' in reads[1]
        if connection.vendor == "postgresql":
            assert reads[0].endswith("FOR UPDATE OF n")  # what it read of the node holds until it commits
            assert "set_config('synchronous_commit', 'off', true)" in reads[0]  # no waiting for the disk

    def test_each_changed_gpu_gets_its_own_values_in_every_field(self, client: Client) -> None:
        # console/fleet/writes.py writes the rows in plain SQL, one parameter set per row: a value
        # must land in its own row and column, and the rows the report repeats keep theirs
        agent = enroll(client, "w1", gpus=8)
        assert agent.post("/agent/v1/report", report_body("w1", seq=1, gpus=8)).status_code == 200
        before = {g.uuid: g for g in Gpu.objects.filter(node__node_id="w1")}
        body = report_body("w1", seq=2, gpus=8)
        body["gpus"][1].update(mem_used_bytes=11 * GIB, sm_util=0.11, temperature_c=41.0)
        body["gpus"][2].update(healthy=False, xid_errors=79)
        body["gpus"][6].update(allocatable=False, ecc_errors=3, mem_used_bytes=66 * GIB)
        assert agent.post("/agent/v1/report", body).status_code == 200
        after = {g.uuid: g for g in Gpu.objects.filter(node__node_id="w1")}
        fields = ("mem_used_bytes", "sm_util", "temperature_c", "healthy", "allocatable", "xid_errors", "ecc_errors")
        for i, sent in enumerate(body["gpus"]):
            row = after[f"GPU-w1-{i}"]
            assert {f: getattr(row, f) for f in fields} == {f: sent[f] for f in fields}, i
            moved = row.updated_at != before[row.uuid].updated_at
            assert moved == (i in (1, 2, 6)), i
        assert after["GPU-w1-1"].updated_at == Node.objects.get(node_id="w1").reported_at

    def test_a_report_that_repeats_the_last_one_writes_no_gpu_row(self, client: Client) -> None:
        agent = enroll(client, "r1", gpus=8)
        assert agent.post("/agent/v1/report", report_body("r1", seq=1, gpus=8)).status_code == 200
        samples = GpuSample.objects.count()
        with CaptureQueriesContext(connection) as ctx:
            assert agent.post("/agent/v1/report", report_body("r1", seq=2, gpus=8)).status_code == 200
        assert GpuSample.objects.count() == samples
        assert not any('"fleet_gpu"' in sql for sql in _writes(ctx))
        assert Node.objects.get(node_id="r1").last_seq == 2  # seen all the same


class TestDeltaBodies:
    def test_a_delta_report_may_list_no_gpu_and_keeps_the_others(self, client: Client) -> None:
        agent = enroll(client, "d1", gpus=4)
        assert agent.post("/agent/v1/report", report_body("d1", seq=1, used_gib=20)).status_code == 200
        delta = {**report_body("d1", seq=2), "gpus": [], "full": False}
        assert agent.post("/agent/v1/report", delta).status_code == 200
        assert set(Gpu.objects.filter(node__node_id="d1").values_list("mem_used_bytes", flat=True)) == {20 * GIB}

    @pytest.mark.parametrize("full,gpus,field", [(True, [], "gpus"), ("no", None, "full"), (False, "x", "gpus")])
    def test_a_bad_body_is_refused_naming_the_field(self, client: Client, full: Any, gpus: Any, field: str) -> None:
        agent = enroll(client, "d2", gpus=2)
        body = report_body("d2", seq=1, gpus=2)
        if full is not None:
            body["full"] = full
        if gpus is not None:
            body["gpus"] = gpus
        resp = agent.post("/agent/v1/report", body)
        assert resp.status_code == 400 and field in resp.json()["errors"], resp.json()
        assert Node.objects.get(node_id="d2").last_seq == 0


class Recording(httpx.BaseTransport):
    """The console, in this process (Django's test client: the test's database transaction), remembering
    each report body sent to it."""

    def __init__(self) -> None:
        self.django = Client()
        self.reports: list[dict[str, Any]] = []
        self.fail_next = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        if request.url.path == "/agent/v1/report":
            if self.fail_next:  # the network drops this one before it reaches the console
                self.fail_next = False
                raise httpx.ConnectError("dropped", request=request)
            self.reports.append(json.loads(body))
        headers = {"Authorization": request.headers["Authorization"]}
        if request.method == "POST":
            resp = self.django.post(request.url.path, body, content_type="application/json", headers=headers)
        else:
            resp = self.django.get(request.url.path, dict(request.url.params), headers=headers)
        return httpx.Response(resp.status_code, content=resp.content, headers={"Content-Type": resp["Content-Type"]})


def _state(gpus: int, changed: dict[int, int] | None = None) -> tuple[GpuReport, ...]:
    used = {i: 10 * GIB for i in range(gpus)} | (changed or {})
    return tuple(GpuReport(uuid=f"GPU-c1-{i}", mem_used_bytes=used[i], mem_total_bytes=80 * GIB, sm_util=0.5,
                           temperature_c=50.0, healthy=True) for i in range(gpus))


def test_an_agent_sends_deltas_between_full_reports_and_the_console_keeps_the_whole_state(settings: Any) -> None:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN_TOKEN
    rec = Recording()
    client = AgentClient("http://testserver", JOIN_TOKEN, transport=rec)
    gpus = tuple(GpuInfo(uuid=f"GPU-c1-{i}", index=i, model="H100-SXM", mem_total_bytes=80 * GIB) for i in range(8))
    epoch = client.register(RegisterRequest(node_id="c1", hostname="c1", agent_version="t", gpus=gpus)).epoch
    assert client.deltas is not None
    seq = 0

    def send(state: tuple[GpuReport, ...]) -> None:
        nonlocal seq
        seq += 1
        client.report(Report(node_id="c1", epoch=epoch, seq=seq, gpus=state))

    send(_state(8))
    send(_state(8, {2: 30 * GIB}))
    send(_state(8, {2: 30 * GIB}))
    assert "full" not in rec.reports[0] and len(rec.reports[0]["gpus"]) == 8  # the first one says everything
    assert rec.reports[1]["full"] is False and [g["uuid"] for g in rec.reports[1]["gpus"]] == ["GPU-c1-2"]
    assert rec.reports[2]["full"] is False and rec.reports[2]["gpus"] == []
    stored = dict(Gpu.objects.filter(node__node_id="c1").values_list("uuid", "mem_used_bytes"))
    assert stored == {f"GPU-c1-{i}": (30 if i == 2 else 10) * GIB for i in range(8)}

    rec.fail_next = True  # lost on the way: did it arrive? the next report must say everything
    with pytest.raises(httpx.ConnectError):
        send(_state(8, {5: 40 * GIB}))
    send(_state(8, {5: 40 * GIB}))
    assert "full" not in rec.reports[-1] and len(rec.reports[-1]["gpus"]) == 8
    assert Gpu.objects.get(uuid="GPU-c1-5").mem_used_bytes == 40 * GIB

    for _ in range(client.deltas.every):
        send(_state(8, {5: 40 * GIB}))
    fulls = [i for i, body in enumerate(rec.reports) if "full" not in body]
    assert fulls[-1] - fulls[-2] == client.deltas.every  # a full report at least every `every`


def test_an_agent_goes_back_to_full_reports_for_a_console_that_refuses_them() -> None:
    bodies: list[dict[str, Any]] = []

    def older_console(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.read())
        bodies.append(body)
        if "full" in body:
            return httpx.Response(400, json={"errors": {"full": "unknown field"}})
        return httpx.Response(200, json={"accepted": body["seq"]})

    client = AgentClient("http://old", "fpa_x", transport=httpx.MockTransport(older_console))
    for seq in (1, 2):
        assert client.report(Report(node_id="c1", epoch=1, seq=seq, gpus=_state(2))) == seq
    assert client.deltas is None
    assert [("full" in b, len(b["gpus"])) for b in bodies] == [(False, 2), (True, 0), (False, 2)]
