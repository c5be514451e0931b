from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _fast_transitions(settings: Any) -> None:
    """Short dwell and back-off so in-process transitions take fractions of a second. The step timeouts
    stay generous: a step is timed on the wall clock, and on a loaded machine a 5 s timeout fired and
    rolled a test's transition back (the dwell and back-off are waits, not deadlines)."""
    settings.FLEXPIPE_CANARY_DWELL_S = 0.2
    settings.FLEXPIPE_RETRY_BACKOFF_S = 0.2
    settings.FLEXPIPE_DRAIN_BUDGET_S = 1.0
    settings.FLEXPIPE_STEP_TIMEOUT_S = 60.0
    settings.FLEXPIPE_MOVE_TIMEOUT_S = 120.0
    settings.FLEXPIPE_PREPARE_TIMEOUT_S = 120.0
