import pytest

from tests.agents.engines.conftest import tiny_model  # noqa: F401 - the tiny model's folder, per session
from tests.agents.engines.vllm.conftest import skip_vllm_tests_without_venv


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_vllm_tests_without_venv(items)
