from tests.agents.engines.conftest import tiny_model  # noqa: F401 - the tiny model's folder, per session
