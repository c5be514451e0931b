"""console/gctune.py: the web processes' garbage-collector thresholds from FLEXPIPE_GC_THRESHOLDS."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from console import gctune


@pytest.fixture(autouse=True)
def _restore_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_setting_sets_the_three_thresholds_and_python_leaves_them() -> None:
    gc.set_threshold(700, 10, 10)
    with override_settings(FLEXPIPE_GC_THRESHOLDS="python"):
        gctune.apply()
    assert gc.get_threshold() == (700, 10, 10)
    with override_settings(FLEXPIPE_GC_THRESHOLDS=" 50000, 20,100 "):
        gctune.apply()
    assert gc.get_threshold() == (50000, 20, 100)


@pytest.mark.parametrize("raw", ["50000,20", "a,b,c", "0,10,10", "50000,20,100,1", "-1,1,1"])
def test_a_bad_value_stops_the_start_naming_the_setting_and_changes_nothing(raw: str) -> None:
    gc.set_threshold(700, 10, 10)
    with override_settings(FLEXPIPE_GC_THRESHOLDS=raw), pytest.raises(ImproperlyConfigured,
                                                                      match="FLEXPIPE_GC_THRESHOLDS: must be three"):
        gctune.apply()
    assert gc.get_threshold() == (700, 10, 10)
