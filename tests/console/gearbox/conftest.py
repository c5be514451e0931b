from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _fast_transitions(settings: Any) -> None:
    """Short dwell and back-off so in-process transitions take fractions of a second."""
    settings.FLEXPIPE_CANARY_DWELL_S = 0.2
    settings.FLEXPIPE_RETRY_BACKOFF_S = 0.2
    settings.FLEXPIPE_DRAIN_BUDGET_S = 1.0
    settings.FLEXPIPE_STEP_TIMEOUT_S = 5.0
    settings.FLEXPIPE_MOVE_TIMEOUT_S = 10.0
    settings.FLEXPIPE_PREPARE_TIMEOUT_S = 10.0
