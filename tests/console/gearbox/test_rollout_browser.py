"""A real browser rolls a version out from the Registry page: its tokenizer fails on the shadow plan, the
rollout rolls back, and the version that served keeps serving. Screenshot: artifacts/rollout-rolled-back.png.

The server reads model files under this class's root only (set before daphne forks); the fleet is
the database-backed simulated agents of tests/console/gearbox/ops.py, which check a version's
tokenizer on the shadow plan as real agents do (agents/shadow_check.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from django.test import override_settings

from agents.engines.torch.weights import write_tokenizer
from console.gateway.views import _deployment as gateway_deployment
from console.gateway.views import _tokenizer_path
from console.gearbox.models import Deployment, Transition
from console.gearbox.rollout import do_rollout_version
from console.registry.actions import VersionSpec, do_register_model_version
from console.registry.models import ModelVersion
from tests.browser import WAIT_MS, screenshot
from tests.console.gearbox.ops import drive, running_deployment
from tests.console.pagetools import LivePageTestCase, chromium, elsewhere, log_in
from tests.console.people import make_person

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM

pytestmark = [pytest.mark.browser]


def register(root: Path, version: str, folder: str) -> ModelVersion:
    spec = VersionSpec(name="Llama-3-8B", version=version, engine="vllm", architecture="Llama-3-8B",
                       weights_uri=f"hf://meta/llama-3-8b-{version}/model.safetensors",
                       sha256=hashlib.sha256(version.encode()).hexdigest(), tokenizer=str(root / folder),
                       max_context=8192, min_gpu_mem_bytes=2**34, warmup_tokens=16)
    return do_register_model_version(spec, actor="user:alice").version


class RolloutInTheBrowser(LivePageTestCase):

    @classmethod
    def setUpClass(cls) -> None:
        cls.root = Path(tempfile.mkdtemp(prefix="rollout-page-"))
        write_tokenizer(cls.root / "v1", vocab_size=512, max_context=8192)
        cls._roots = override_settings(FLEXPIPE_MODEL_ROOTS=[cls.root], FLEXPIPE_CANARY_DWELL_S=0.2)
        cls._roots.enable()
        super().setUpClass()

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        cls._roots.disable()
        shutil.rmtree(cls.root, ignore_errors=True)

    def setUp(self) -> None:
        make_person("oscar", "operator")
        self.world = running_deployment(moved=False)
        self.v1 = register(self.root, "v1", "v1")
        assert do_rollout_version("chat", self.v1, actor="system:test")[0] == "started"
        drive(self.world.agents)
        for node in ("a1", "b1"):
            self.world.reporter.report(node)
        shutil.rmtree(self.root / "v2", ignore_errors=True)
        shutil.copytree(self.root / "v1", self.root / "v2")
        self.v2 = register(self.root, "v2", "v2")  # its tokenizer loads now, at registration...
        (self.root / "v2" / "tokenizer.json").write_text('{"truncated": ')  # ...and is broken before it rolls out

    def test_a_rollout_whose_tokenizer_fails_rolls_back_and_the_old_version_keeps_serving(self) -> None:
        dep = Deployment.objects.get(name="chat")
        assert dep.model_version_id == self.v1.pk
        serving = (dep.current_gear, dep.routing)
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "oscar", "/registry/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            v1_row, v2_row = (f"#versions tr[data-id='{v.pk}']" for v in (self.v1, self.v2))
            assert page.inner_text(f"{v1_row} td.serving") == "chat"
            assert page.inner_text(f"{v2_row} td.serving") == "—"
            assert page.locator(f"{v1_row} button.rollout").count() == 0  # it serves its one deployment already
            page.select_option(f"{v2_row} select.rollout-target", "chat")
            page.click(f"{v2_row} button.rollout")
            # the answer, whichever it is (a refusal shows its reason here rather than as a timeout)
            started = page.wait_for_selector(f"{v2_row} .result.ok[data-seq], {v2_row} .result.bad", timeout=WAIT_MS)
            assert "ok" in (started.get_attribute("class") or ""), started.inner_text()
            seq = int(started.get_attribute("data-seq") or 0)
            assert "rollout #" in started.inner_text() and "canary first" in started.inner_text()
            t = Transition.objects.get(deployment__name="chat", seq=seq)
            assert t.kind == "rollout" and t.model_version_id == self.v2.pk

            rolled = elsewhere(drive, self.world.agents)  # the agents prepare the shadow plan: its tokenizer fails
            assert rolled.phase == "rolled_back" and "tokenizer" in rolled.error

            started.query_selector("a").click()  # to the rollout's review page
            page.wait_for_selector(f"section.transition[data-seq='{seq}']", timeout=WAIT_MS)
            page.wait_for_function(f"""() => document.querySelector("section.transition[data-seq='{seq}'] .t-phase")
                                       .textContent.includes("rolled_back")""", timeout=WAIT_MS)
            assert "does not load" in page.inner_text(f"section.transition[data-seq='{seq}']")

            page.goto(f"{self.live_server_url}/deployments/chat/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            assert "Llama-3-8B @v1" in page.inner_text("#facts")
            page.wait_for_selector(f"#transitions tr[data-seq='{seq}'][data-kind=rollout][data-phase=rolled_back]")
            screenshot(page, "rollout-rolled-back")
        dep = Deployment.objects.get(name="chat")
        assert dep.model_version_id == self.v1.pk and (dep.current_gear, dep.routing) == serving
        assert _tokenizer_path(gateway_deployment("chat")) == str(self.root / "v1")  # type: ignore[arg-type]
