"""The official `openai` client against a live daphne serving the gateway, in front of real PlanHosts.

The daphne process is forked before the plans start (ChannelsLiveServerTestCase.setUpClass); the
PlanHosts (torch workers) and their data servers run in the test process, on two "nodes".
"""

from __future__ import annotations

import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from channels.testing import ChannelsLiveServerTestCase
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from agents.dataplane import PlanHost
from agents.engines.torch.weights import make_tiny_llama
from console.gateway import decisions, tokens
from console.gearbox.models import Deployment
from tests.agents.dataplane.conftest import PLAN_PP2, PLAN_TP1, PLAN_TP2
from tests.console.gateway.world import Hosts, make_deployment, make_node, route, set_routes
from tests.console.pagetools import _ForkedDaphne
from tests.console.people import make_person

PROMPT = "the quick brown fox jumps over the lazy dog"
GREEDY = {"ignore_eos": True, "return_token_ids": True}


class GatewayLive(ChannelsLiveServerTestCase):
    serve_static = False
    ProtocolServerProcess = _ForkedDaphne
    hosts: Hosts
    a: PlanHost
    b: PlanHost
    c: PlanHost

    @classmethod
    def setUpClass(cls) -> None:
        cls.model_dir = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
        cls.sha = make_tiny_llama(cls.model_dir)
        cls._gw = override_settings(FLEXPIPE_GATEWAY_TOKENIZERS={"tiny-llama": str(cls.model_dir)},
                                    FLEXPIPE_GATEWAY_FROZEN_WAIT_S=10.0, FLEXPIPE_GATEWAY_LOAD_INTERVAL_S=0.0,
                                    FLEXPIPE_GATEWAY_FAILOVER_WAIT_S=2.0, FLEXPIPE_ROUTER_SAMPLE_S=0.0)
        cls._gw.enable()
        super().setUpClass()  # forks daphne with these settings
        cls.hosts = Hosts(cls.model_dir, cls.sha)
        cls.a = cls.hosts.run("a1", PLAN_TP1)
        cls.b = cls.hosts.run("b1", PLAN_PP2)
        cls.c = cls.hosts.run("b1", PLAN_TP2)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.hosts.close()
        super().tearDownClass()
        cls._gw.disable()

    def setUp(self) -> None:
        self.token = make_person("vera", "viewer").token
        make_node("a1", self.hosts.addr("a1"))
        make_node("b1", self.hosts.addr("b1"))
        make_deployment("tiny", [route(self.a, "a1")])
        self.client = openai.OpenAI(base_url=f"{self.live_server_url}/v1", api_key=self.token, max_retries=0)

    def no_switch(self, max_tokens: int) -> tuple[str, list[int]]:
        out = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                             extra_body=GREEDY)
        choice = out.choices[0]
        assert choice.finish_reason == "length" and out.usage is not None
        assert out.usage.completion_tokens == max_tokens
        return choice.text, list(choice.model_extra["token_ids"])

    def switched(self, action: str, target: PlanHost) -> None:
        n = 300
        text0, ids0 = self.no_switch(n)
        box: dict[str, Any] = {}

        def switch(seq_id: str) -> None:
            move = {"seq_id": seq_id, "action": action, "target_plan": target.plan_id, "target_node": "b1",
                    "target_addr": self.hosts.addr("b1")}
            try:
                box["result"] = self.a.move([move], routing_version=2)
                set_routes("tiny", [route(target, "b1")])  # the SWITCH's routing commit, for new requests
            finally:
                connection.close()  # this thread's own database connection

        texts: list[str] = []
        ids: list[int] = []
        arrivals: list[float] = []
        finish = None
        worker: threading.Thread | None = None
        stream = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0,
                                                stream=True, extra_body=GREEDY)
        for chunk in stream:
            arrivals.append(time.monotonic())
            choice = chunk.choices[0]
            texts.append(choice.text)
            ids.extend(choice.model_extra.get("token_ids") or [])
            finish = choice.finish_reason or finish
            if worker is None:
                worker = threading.Thread(target=switch, args=(chunk.id,))
                worker.start()
        assert worker is not None
        worker.join(30)

        (moved,) = box["result"]["moved"]
        assert moved["ok"] and moved.get("outcome") != "gone", box["result"]  # it really moved mid-stream
        assert ids == ids0
        assert "".join(texts) == text0
        assert finish == "length"
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        print(f"\ngateway stream, {action} TP1 -> {target.layout.describe()}: largest gap between chunks "
              f"{1000 * max(gaps):.1f} ms (median {1000 * sorted(gaps)[len(gaps) // 2]:.2f} ms), "
              f"hand-over {1000 * moved['stall_s']:.1f} ms")

    def test_a_stream_migrated_mid_way_reads_as_one_stream_with_the_no_switch_tokens(self) -> None:
        self.switched("migrate", self.b)

    def test_a_stream_replayed_mid_way_reads_as_one_stream_with_the_no_switch_tokens(self) -> None:
        self.switched("replay", self.c)

    def test_a_request_with_priority_and_one_without_both_complete_and_the_priority_reaches_the_plan(self) -> None:
        seen: list[int] = []
        admit = self.a.admit

        def spy(*args: Any, **kw: Any) -> Any:
            seen.append(kw.get("priority", 0))
            return admit(*args, **kw)

        self.a.admit = spy  # type: ignore[method-assign]
        try:
            plain = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                                   extra_body=GREEDY)
            urgent = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                                    extra_body={**GREEDY, "priority": -5, "deadline_ms": 30_000})
            with pytest.raises(openai.BadRequestError) as bad:
                self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                               extra_body={"priority": "high"})
        finally:
            del self.a.admit
        assert plain.choices[0].text == urgent.choices[0].text and urgent.choices[0].finish_reason == "length"
        assert seen == [0, -5]  # the refused one reached no plan
        assert bad.value.param == "priority" and "priority" in bad.value.message
        # the router saw it too: a sample of its decisions for the deployment page carries it
        deadline = time.monotonic() + 30
        while not any(d["request"]["priority"] == -5 for d in decisions.recent("tiny", 20)):
            assert time.monotonic() < deadline, "no sampled decision with the request's priority"
            time.sleep(0.05)
        sample = next(d for d in decisions.recent("tiny", 20) if d["request"]["priority"] == -5)
        assert sample["request"]["deadline_ms"] == 30_000 and sample["taken_by"] == self.a.plan_id
        assert sample["chosen"] == self.a.plan_id and sample["note"] == "the only plan"  # nothing to score

    def test_chat_streams_deltas_that_add_up_to_the_whole_answer(self) -> None:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
        whole = self.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                    extra_body={"ignore_eos": True})
        chunks = list(self.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True},
                                                          extra_body={"ignore_eos": True}))

        assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
        assert whole.usage is not None and whole.usage.completion_tokens == 24
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content and streamed
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
        tok = tokens.load(str(self.model_dir))
        prompt = tok.encode(tok.chat_prompt(messages))
        assert whole.usage.prompt_tokens == len(prompt)

    def test_a_prompt_of_token_ids_and_stop_strings(self) -> None:
        text, ids = self.no_switch(40)
        stop = text[10:14]
        assert stop.strip(), text
        cut = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                             stop=[stop], extra_body={"ignore_eos": True})
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
        tok = tokens.load(str(self.model_dir))
        by_ids = self.client.completions.create(model="tiny", prompt=tok.encode(PROMPT), max_tokens=40,
                                                temperature=0, extra_body=GREEDY)
        assert by_ids.choices[0].model_extra["token_ids"] == ids

    def test_a_saturated_plan_gets_429_with_retry_after(self) -> None:
        busy = self.hosts.run("a1", PLAN_TP2, max_waiting=1)
        assert busy.engine is not None
        busy.engine.max_tokens_per_step = 1  # a 480-token prompt waits 480 steps for its first token
        set_routes("tiny", [route(busy, "a1")])
        busy.admit("hog", [(7 * i) % 500 + 3 for i in range(480)], 1, None)

        with pytest.raises(openai.RateLimitError) as caught:
            self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)

        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert caught.value.body["type"] == "rate_limit_error"  # type: ignore[index]
        busy.stop()

    def test_while_the_only_route_is_frozen_a_request_waits_for_the_new_table(self) -> None:
        set_routes("tiny", [route(self.a, "a1", frozen=True)])
        before = self.c.report().arrivals
        result: dict[str, Any] = {}

        def ask() -> None:
            result["out"] = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                                           temperature=0, extra_body={"ignore_eos": True})

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.5)  # the request is waiting now (the wait is 10 s): the switch commits the new table
        assert asker.is_alive()
        set_routes("tiny", [route(self.c, "b1")])
        asker.join(30)

        assert result["out"].choices[0].finish_reason == "length"
        assert self.c.report().arrivals == before + 1  # it went to the plan of the new table

    def test_bad_tokens_get_401_through_the_client(self) -> None:
        bad = openai.OpenAI(base_url=f"{self.live_server_url}/v1", api_key="fpu_wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert [m.id for m in self.client.models.list().data] == ["tiny"]

    def test_requests_feed_the_load_window_and_the_prometheus_counters(self) -> None:
        for _ in range(2):
            self.no_switch(6)

        window = Deployment.objects.get(name="tiny").load_window["samples"]
        scrape = httpx.get(f"{self.live_server_url}/metrics", headers={"Authorization": f"Bearer {self.token}"})

        prompt_len = len(tokens.load(str(self.model_dir)).encode(PROMPT))
        assert len(window) == 2 and all(s[1] > 0 for s in window)  # [t_s, rate_rps, prompt, output, ...]
        assert window[-1][2] == prompt_len and window[-1][3] == 6.0
        assert scrape.status_code == 200
        assert 'flexpipe_gateway_requests_total{deployment="tiny",endpoint="completions",status="200"}' in scrape.text
        assert "flexpipe_gateway_ttft_seconds_bucket" in scrape.text

    def test_a_stream_whose_plan_dies_mid_way_resumes_on_the_routed_plan_with_the_same_tokens(self) -> None:
        n = 300
        _, ids0 = self.no_switch(n)
        failovers = self.failovers()
        doomed = self.hosts.run("a1", PLAN_TP2)
        set_routes("tiny", [route(doomed, "a1")])
        ids: list[int] = []
        arrivals: list[float] = []
        finish = None
        stream = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0,
                                                stream=True, extra_body=GREEDY)
        for chunk in stream:
            arrivals.append(time.monotonic())
            if not ids:
                # the plan's node dies with the sequence on it; the gearbox routes to another plan
                set_routes("tiny", [route(self.a, "a1")])
                doomed.stop()
            ids.extend(chunk.choices[0].model_extra.get("token_ids") or [])
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and ids == ids0  # resumed by replay: the tokens of a run without the loss
        assert self.failovers() == failovers + 1
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        print(f"\nfailover by replay after a plan died: largest gap between chunks {1000 * max(gaps):.0f} ms")

    def failovers(self) -> float:
        scrape = httpx.get(f"{self.live_server_url}/metrics", headers={"Authorization": f"Bearer {self.token}"})
        found = re.search(r'^flexpipe_gateway_failovers_total\{deployment="tiny"\} ([0-9.e+]+)$', scrape.text, re.M)
        return float(found.group(1)) if found else 0.0

    def test_a_plan_lost_mid_stream_with_nothing_to_resume_on_ends_the_stream_with_an_explicit_error(self) -> None:
        doomed = self.hosts.run("a1", PLAN_TP2)
        set_routes("tiny", [route(doomed, "a1")])
        stream = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="data plane failed"):
            for _ in stream:
                set_routes("tiny", [])  # and no plan takes its place within FLEXPIPE_GATEWAY_FAILOVER_WAIT_S
                doomed.release(drain_timeout_s=0.0, fallback=None)  # no fallback: its sequences fail

    def test_a_request_of_a_deployment_at_zero_is_held_streaming_nothing_until_its_gear_is_up(self) -> None:
        _, ids0 = self.no_switch(12)
        Deployment.objects.filter(name="tiny").update(routing=[], zero_since=timezone.now())  # scaled to zero
        colds = self.metric("flexpipe_gateway_cold_starts_total")
        box: dict[str, Any] = {}

        def ask() -> None:
            stream = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                    stream=True, extra_body=GREEDY)
            box["opened"] = time.monotonic()  # the response started: the first chunk follows
            box["ids"] = [i for chunk in stream for i in (chunk.choices[0].model_extra.get("token_ids") or [])]

        asker = threading.Thread(target=ask)
        asker.start()
        deadline = time.monotonic() + 60
        while Deployment.objects.get(name="tiny").wake_requested_at is None:  # the gateway signals demand
            assert time.monotonic() < deadline and asker.is_alive(), "the held request never signalled"
            time.sleep(0.02)
        assert "opened" not in box and asker.is_alive()  # held: nothing streamed, not refused
        up = time.monotonic()
        set_routes("tiny", [route(self.a, "a1")])  # the wake-up transition's SWITCH commits its plan
        asker.join(60)
        assert box["ids"] == ids0 and box["opened"] >= up  # served whole, and only once the gear was up
        assert self.metric("flexpipe_gateway_cold_starts_total") == colds + 1
        assert self.metric("flexpipe_gateway_cold_start_wait_seconds_count", outcome="served") >= 1

    def metric(self, name: str, **labels: str) -> float:
        scrape = httpx.get(f"{self.live_server_url}/metrics", headers={"Authorization": f"Bearer {self.token}"})
        want = ",".join([r'deployment="tiny"'] + [f'{k}="{v}"' for k, v in labels.items()])
        found = re.search(rf'^{name}\{{{want}\}} ([0-9.e+]+)$', scrape.text, re.M)
        return float(found.group(1)) if found else 0.0
