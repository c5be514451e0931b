"""A real browser on the Deployments page's "New deployment" form: the API's refusal shows under the field
it names (and nothing is created), then a good form creates the deployment and the table lists it.
Screenshots: artifacts/new-deployment-*.png."""

from __future__ import annotations

import os

import pytest
from django.utils import timezone

from console.gearbox.models import Deployment
from console.registry.models import ModelVersion
from tests.browser import WAIT_MS, screenshot
from tests.console.gearbox.harness import enroll_fleet
from tests.console.pagetools import LivePageTestCase, chromium, log_in
from tests.console.people import make_person

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM

pytestmark = [pytest.mark.browser]


class NewDeploymentInTheBrowser(LivePageTestCase):
    def setUp(self) -> None:
        make_person("oscar", "operator")
        make_person("vera", "viewer")
        enroll_fleet()
        self.version = ModelVersion.objects.create(
            name="Llama-3-8B", version="v1", engine="vllm", architecture="Llama-3-8B", weights_uri="hf://m/8b/w",
            sha256="e" * 64, tokenizer="/models/tok", max_context=8192, min_gpu_mem_bytes=2**30, warmup_tokens=8,
            status="verified", registered_at=timezone.now(), registered_by="user:alice")

    def test_a_refusal_shows_the_apis_words_and_a_good_form_creates_the_deployment(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "oscar", "/deployments/")
            form = "#new-deployment-form"
            page.wait_for_selector(form)
            assert page.input_value(f"{form} [name=model_version]") == str(self.version.pk)
            page.fill(f"{form} [name=name]", "chat-new")
            page.fill(f"{form} [name=min_replicas]", "3")
            page.fill(f"{form} [name=max_replicas]", "2")
            page.click(f"{form} button[type=submit]")
            error = page.wait_for_selector(f"{form} .field-error[data-field=min_replicas]", timeout=WAIT_MS)
            assert "must be at most max_replicas (2)" in error.inner_text()
            assert page.inner_text("#new-deployment-result") == "refused (400)"
            screenshot(page, "new-deployment-refused")
            assert not Deployment.objects.filter(name="chat-new").exists()

            # a spec on GPUs that do not exist: the API's own words, under the baseline field
            page.fill(f"{form} [name=min_replicas]", "1")
            page.fill(f"{form} [name=baseline_gear]", '{"plans": [{"stages": [{"gpus": ["z9/0"]}]}]}')
            page.click(f"{form} button[type=submit]")
            error = page.wait_for_selector(f"{form} .field-error[data-field^=baseline_gear]", timeout=WAIT_MS)
            assert "no GPU 'z9/0' in the fleet" in error.inner_text()
            assert not Deployment.objects.filter(name="chat-new").exists()

            page.fill(f"{form} [name=baseline_gear]", "auto")
            page.click(f"{form} button[type=submit]")
            page.wait_for_selector("#new-deployment-result.ok", timeout=WAIT_MS)
            assert page.inner_text("#new-deployment-result").startswith("created chat-new (baseline TP")
            page.wait_for_selector("#deployments tbody tr:has-text('chat-new')", timeout=WAIT_MS)
            screenshot(page, "new-deployment-created")
            assert Deployment.objects.filter(name="chat-new", created_by__username="oscar").exists()

    def test_a_viewer_gets_no_form(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "vera", "/deployments/")
            page.wait_for_selector("#deployments")
            assert page.query_selector("#new-deployment-form") is None
