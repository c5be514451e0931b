"""A real browser on the Registry page: quarantine badges, the admin's controls, and a viewer without them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from django.test import override_settings

from agents.engines.torch.weights import write_tokenizer
from console.registry import actions
from console.registry.models import ModelVersion
from tests.browser import WAIT_MS, screenshot
from tests.console.pagetools import LivePageTestCase, chromium, elsewhere, log_in
from tests.console.people import make_person
from tests.console.registry.conftest import OTHER_SHA256, model_body

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM

pytestmark = [pytest.mark.browser]


class RegistryPageInTheBrowser(LivePageTestCase):
    """The server (forked at class setup) reads model files under one root: this class's folder."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.root = Path(tempfile.mkdtemp(prefix="registry-page-"))
        write_tokenizer(cls.root / "tiny", vocab_size=512, max_context=512)
        cls._roots = override_settings(FLEXPIPE_MODEL_ROOTS=[cls.root])
        cls._roots.enable()
        super().setUpClass()

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        cls._roots.disable()
        shutil.rmtree(cls.root, ignore_errors=True)

    def setUp(self) -> None:
        self.alice = make_person("alice", "admin")
        make_person("vera", "viewer")
        api = self.alice.api()
        for body in (model_body(), model_body(name="Llama-3-8B", version="2026-11", architecture="Llama-3-8B",
                                              engine="vllm", sha256=hashlib.sha256(b"8b").hexdigest(),
                                              max_context=8192, min_gpu_mem_bytes=24 * 2**30)):
            resp = api.post("/api/v1/models", json.dumps(body), content_type="application/json")
            assert resp.status_code == 201, resp.content
        self.remote = ModelVersion.objects.get(name="tiny-llama")
        actions.do_record_weights_check(ModelVersion.objects.get(name="Llama-3-8B"),
                                        observed_sha256=hashlib.sha256(b"8b").hexdigest(), node_id="a1")
        self.weights = self.root / "model.safetensors"
        self.weights.write_bytes(b"weights the admin registers with a wrong digest")

    def test_an_admin_registers_a_bad_digest_sees_it_quarantined_and_retires_a_version(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "alice", "/registry/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            page.evaluate("window.__sameDocument = true")

            # An agent reports another digest for the remote version: the badge turns, live.
            elsewhere(actions.do_record_weights_check, self.remote, observed_sha256=OTHER_SHA256, node_id="a1")
            row = f"#versions tr[data-id='{self.remote.pk}']"
            page.wait_for_selector(f"{row}[data-status=quarantined] .pill[data-status=quarantined]", timeout=WAIT_MS)
            assert f"observed {OTHER_SHA256[:12]}… ≠ registered {self.remote.sha256[:12]}… · agent:a1" in page.inner_text(row)

            # The register form: a refusal names the field, then a local file with a wrong digest.
            form = "#register-form"
            page.fill(f"{form} [name=name]", "local-tiny")
            page.fill(f"{form} [name=version]", "v1")
            page.fill(f"{form} [name=architecture]", "tiny-llama")
            page.fill(f"{form} [name=weights_uri]", f"file://{self.weights}")
            page.fill(f"{form} [name=sha256]", "not-hex")
            page.fill(f"{form} [name=tokenizer]", str(self.root / "tiny"))
            page.fill(f"{form} [name=max_context]", "512")
            page.fill(f"{form} [name=min_gpu_mem_bytes]", str(2**30))
            page.click(f"{form} button[type=submit]")
            error = page.wait_for_selector(".field-error[data-field=sha256]", timeout=WAIT_MS)
            assert "64 lowercase hexadecimal" in error.inner_text()
            assert not ModelVersion.objects.filter(name="local-tiny").exists()

            page.fill(f"{form} [name=sha256]", OTHER_SHA256)
            page.click(f"{form} button[type=submit]")
            page.wait_for_selector("#register-result.bad", timeout=WAIT_MS)
            local = ModelVersion.objects.get(name="local-tiny")
            assert local.status == "quarantined"
            assert local.observed_sha256 == hashlib.sha256(self.weights.read_bytes()).hexdigest()
            page.wait_for_selector(f"#versions tr[data-id='{local.pk}'][data-status=quarantined]")
            assert page.locator(".counts .pill[data-status=quarantined]").inner_text() == "2 quarantined"
            screenshot(page, "registry")

            # Retire asks for a confirmation first.
            retire_row = f"#versions tr[data-id='{local.pk}']"
            page.click(f"{retire_row} button.retire")
            page.fill(f"{retire_row} input.retire-reason", "bad upload")
            page.click(f"{retire_row} button.confirm-retire")
            page.wait_for_selector(f"{retire_row}[data-status=retired]", timeout=WAIT_MS)
            local.refresh_from_db()
            assert local.status == "retired" and local.retired_by == "user:alice"
            assert page.evaluate("window.__sameDocument") is True

    def test_a_viewer_sees_the_quarantine_badge_but_no_register_form_or_retire_button(self) -> None:
        actions.do_record_weights_check(self.remote, observed_sha256=OTHER_SHA256, node_id="a1")
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "vera", "/registry/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            page.wait_for_selector(f"#versions tr[data-id='{self.remote.pk}'] .pill[data-status=quarantined]")
            assert page.locator("#versions tbody tr").count() == 2
            assert page.locator("#register-form").count() == 0
            assert page.locator("button.retire").count() == 0
            assert page.locator("#versions thead th").count() == 9  # no actions column
            screenshot(page, "registry-viewer")
