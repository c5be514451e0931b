"""manage.py register_local_model: how `make run ENGINE=torch` registers the tiny model it made."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from agents.engines.torch.weights import make_tiny_llama
from console.registry.models import ModelVersion

pytestmark = pytest.mark.django_db


def test_it_registers_a_folder_once_with_its_weights_digest(tmp_path: Path) -> None:
    sha = make_tiny_llama(tmp_path / "tiny")
    out = StringIO()
    call_command("register_local_model", "tiny-llama", str(tmp_path / "tiny"), stdout=out)
    call_command("register_local_model", "tiny-llama", str(tmp_path / "tiny"), stdout=out)
    v = ModelVersion.objects.get()
    assert (v.name, v.version, v.engine, v.sha256, v.status) == ("tiny-llama", "local", "torch", sha, "verified")
    assert v.tokenizer == str((tmp_path / "tiny").resolve()) and v.max_context == 512
    assert out.getvalue().splitlines()[1].startswith("tiny-llama local: already registered")


def test_a_folder_without_weights_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="model.safetensors does not exist"):
        call_command("register_local_model", "tiny-llama", str(tmp_path))
    assert not ModelVersion.objects.exists()
