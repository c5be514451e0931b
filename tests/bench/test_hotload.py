"""bench.hotload on a small model: the figures it writes, and bad flags refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import hotload


def test_it_measures_both_sources_and_both_warm_ups_and_writes_consistent_ratios(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hot.json"
    assert hotload.main(["--layers", "1", "--hidden", "128", "--repeat", "1", "--starts", "1", "--requests", "2",
                         "--prompt-tokens", "8", "--warmup-tokens", "4", "--dir", str(tmp_path),
                         "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    load = r["load"]
    assert r["weights_bytes"] > 0 and set(load) == {"disk", "host_cache"}
    for x in load.values():
        assert x["read_gbps"] > 0 and x["start_s"] > 0
        assert x["start_gbps"] == pytest.approx(r["weights_bytes"] / x["start_s"] / 1e9, rel=0.05)  # start_s is rounded to the microsecond
    assert r["ratios"]["read_gbps_host_over_disk"] == pytest.approx(
        load["host_cache"]["read_gbps"] / load["disk"]["read_gbps"], rel=0.01)
    assert set(r["warmup"]["by_warmup_tokens"]) == {"0", "4"}
    assert "host_cache / disk" in capsys.readouterr().out
    assert not list(tmp_path.glob("tmp*")), "the disk copy is removed afterwards"


@pytest.mark.parametrize("flag", [["--repeat", "0"], ["--hidden", "100"], ["--warmup-tokens", "0"]])
def test_a_bad_flag_is_an_error_naming_it(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        hotload.main(flag)
    assert flag[0] in capsys.readouterr().err
