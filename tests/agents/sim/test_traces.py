"""Trace files as arrivals: the format read from the file, times from 0, bad lines named."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.sim.traces import read_trace

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "traces"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_a_mooncake_jsonl_gives_times_from_zero_lengths_and_block_ids(tmp_path: Path) -> None:
    p = write(tmp_path, "t.jsonl", '{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n'
                                   '\n{"timestamp": 3500, "input_length": 600, "output_length": 9, "hash_ids": [0, 7]}\n')
    t = read_trace(p)
    assert t.format == "mooncake" and t.block_tokens == 512 and t.span_s == 2.5
    assert [(a.t_s, a.prompt_tokens, a.output_tokens, a.blocks) for a in t.arrivals] == [
        (0.0, 1100, 5, (0, 1, 2)), (2.5, 600, 9, (0, 7))]


def test_an_azure_csv_gives_times_from_its_dates_with_seven_fractional_digits(tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                 "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.0319600,3180,8\n")
    t = read_trace(p)
    assert t.format == "azure" and t.block_tokens == 0
    assert [(round(a.t_s, 6), a.prompt_tokens, a.output_tokens, a.blocks) for a in t.arrivals] == [
        (0.0, 4808, 10, ()), (1.052, 3180, 8, ())]


def test_requests_longer_than_the_context_are_cut_with_their_block_ids(tmp_path: Path) -> None:
    p = write(tmp_path, "t.jsonl", '{"timestamp": 0, "input_length": 3000, "output_length": 50, '
                                   '"hash_ids": [1, 2, 3, 4, 5, 6]}\n')
    t = read_trace(p, context_tokens=2048)
    (a,) = t.arrivals
    assert (a.prompt_tokens, a.output_tokens, a.blocks, t.clipped) == (2047, 1, (1, 2, 3, 4), 1)


@pytest.mark.parametrize(("name", "text", "msg"), [
    ("a.jsonl", '{"timestamp": 0, "input_length": 0, "output_length": 1}\n', "line 1.input_length: must be a number >= 1"),
    ("b.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}\n',
     "line 1.hash_ids: must be a list of integers"),
    ("c.jsonl", '{"timestamp": 9, "input_length": 5, "output_length": 1}\n{"timestamp": 3, "input_length": 5, '
                '"output_length": 1}\n', "line 2.timestamp: goes back in time"),
    ("d.jsonl", "{not json\n", "line 1: not JSON"),
    ("e.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", "line 2.TIMESTAMP: not a date and time"),
    ("f.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,five,5\n",
     "line 2.ContextTokens: must be an integer"),
    ("g.txt", "hello\n", "neither Mooncake JSONL"),
])
def test_a_bad_line_is_an_error_naming_the_file_the_line_and_the_field(tmp_path: Path, name: str, text: str,
                                                                        msg: str) -> None:
    with pytest.raises(ValueError, match=msg.replace(".", r"\.").replace("(", r"\(")):
        read_trace(write(tmp_path, name, text))


@pytest.mark.skipif(not SHARED.is_dir(), reason="the team's shared traces are not next to this checkout")
def test_the_shared_traces_read_as_their_readme_says() -> None:
    mc = read_trace(SHARED / "mooncake-synthetic.jsonl")
    code = read_trace(SHARED / "azure-llm-2023-code.csv")
    assert (mc.format, len(mc.arrivals), code.format, len(code.arrivals)) == ("mooncake", 3993, "azure", 8819)
