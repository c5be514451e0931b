"""console/gctune.py: the web processes' garbage-collector thresholds (FLEXPIPE_GC_THRESHOLDS) and freezer (FLEXPIPE_GC_FREEZE)."""

from __future__ import annotations

import gc
import weakref
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


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # nothing this test froze stays out of the collector's sight


def test_a_freeze_hides_what_survives_from_collections_until_the_sweep(_unfrozen: None) -> None:
    freezer = gctune.Freezer(freeze_s=1.0, sweep_s=300.0)
    assert freezer.step(0.5) == ""
    cycle = weakref.ref(_Cycle())
    assert freezer.step(1.0) == "freeze"
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert cycle() is not None  # frozen: no collection visits it
    assert freezer.step(1.5) == ""  # not due again yet
    assert freezer.step(299.0) == "freeze"
    assert freezer.step(300.0) == "sweep"
    assert cycle() is None  # the sweep unfroze and collected everything
    assert freezer.sweeps == 1
    assert gc.get_freeze_count() > 0  # what survived the sweep is frozen again
    assert freezer.step(300.5) == "" and freezer.step(301.0) == "freeze"


def test_the_freeze_setting_off_keeps_python_s_collector_and_the_thread_waits_for_a_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gctune, "_freezer", None)  # what the process had comes back after the test
    assert gctune.freeze_periods("off") is None
    assert gctune.freeze_periods(" 2, 600 ") == (2.0, 600.0)
    with override_settings(FLEXPIPE_GC_FREEZE="off"):
        gctune.apply()
    assert gctune._freezer is None and gctune.start_freezer() is False
    with override_settings(FLEXPIPE_GC_FREEZE="1,300"):
        gctune.apply()
    assert gctune._freezer is not None and gctune._freezer._thread is None  # not in a test process by itself


@pytest.mark.parametrize("raw", ["1", "300,1", "0,300", "a,b", "1,1", "-1,300", "1,2,3"])
def test_a_bad_freeze_value_stops_the_start_naming_the_setting(raw: str) -> None:
    with override_settings(FLEXPIPE_GC_FREEZE=raw), pytest.raises(ImproperlyConfigured,
                                                                  match="FLEXPIPE_GC_FREEZE: must be"):
        gctune.apply()


def test_a_process_whose_twisted_reactor_is_installed_but_not_running_starts_no_freezer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # importing daphne's server installs Twisted's reactor: a test process that ran a live server
    # has it, and its requests through console.asgi must not start the freezer meant for daphne
    import sys
    import types

    from console import asgi

    freezer = gctune.Freezer(freeze_s=1.0, sweep_s=300.0)
    monkeypatch.setattr(gctune, "_freezer", freezer)
    monkeypatch.delattr(asgi._hook_server_shutdown, "done", raising=False)
    if "twisted.internet.reactor" not in sys.modules:  # a reactor that is installed and not running
        monkeypatch.setitem(sys.modules, "twisted.internet.reactor", types.SimpleNamespace(running=False))
    asgi._hook_server_shutdown()
    assert freezer._thread is None
    assert not getattr(asgi._hook_server_shutdown, "done", False)
