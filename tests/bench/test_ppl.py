"""The perplexity benchmark's bookkeeping: sizes, spans, curves and the claims it checks."""

import math

import pytest
import torch

from streamchat import defaults
from streamchat.bench import ppl
from streamchat.bench.options import sizes_for
from streamchat.errors import ConfigError
from tests.support.tokenizers import byte_level_tokenizer


def run(policy: str, nll: list[float], seconds: float = 2.0) -> ppl.PolicyRun:
    return ppl.PolicyRun(policy, torch.tensor(nll, dtype=torch.float64), seconds)


def test_quick_and_full_sizes_take_the_options_given():
    assert sizes_for(False, ppl.FULL, ppl.QUICK) == ppl.FULL
    assert ppl.FULL.tokens == defaults.PPL_TOKENS and ppl.FULL.capacity == 1024
    sizes = sizes_for(True, ppl.FULL, ppl.QUICK, tokens=500, chunk=None)
    assert (sizes.tokens, sizes.chunk, sizes.window) == (500, ppl.QUICK.chunk, ppl.QUICK.window)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokens": 1}, "--tokens 1: must be at least 2"),
        ({"sinks": -1}, "--keep -1: must be at least 0"),
        ({"window": 0, "chunk": 1}, "--window 0: must be at least 1"),
        ({"chunk": 0}, "--chunk 0: must be at least 1"),
        ({"chunk": 2000}, "--chunk 2000: a chunk must fit the window"),
        ({"longer_keep": -1}, "--longer-keep -1: must be at least 0"),
    ],
)
def test_impossible_sizes_are_refused_naming_the_option(overrides, message):
    with pytest.raises(ConfigError, match=message):
        sizes_for(False, ppl.FULL, ppl.QUICK, **overrides)


def test_a_kept_prefix_must_leave_room_for_a_chunk_when_the_keep_policy_runs():
    ppl.require_keep_fits(ppl.FULL)
    too_long = sizes_for(False, ppl.FULL, ppl.QUICK, longer_keep=1000)
    message = (
        r"^--longer-keep 1000: the 24 tokens it leaves of the cache must hold a --chunk of 64; keep at most 960, or"
    )
    with pytest.raises(ConfigError, match=message):
        ppl.require_keep_fits(too_long)


def test_policies_come_in_the_table_order_whatever_the_order_given():
    assert ppl.parse_policies(None) == defaults.BENCH_POLICIES
    assert ppl.parse_policies(" streaming,dense ") == ("dense", "streaming")
    for bad in ("stream", "", ","):
        with pytest.raises(ConfigError, match="choose from dense, window, recompute, streaming, keep"):
            ppl.parse_policies(bad)


def test_a_span_is_the_perplexity_of_exactly_its_tokens():
    # nll[i] belongs to token i + 1: tokens 1..4 here.
    scored = run("streaming", [math.log(2), math.log(4), math.log(8), math.log(16)])
    assert scored.ppl() == pytest.approx(math.exp((math.log(2) + math.log(4) + math.log(8) + math.log(16)) / 4))
    assert scored.ppl(2, 4) == pytest.approx(math.sqrt(4 * 8))
    assert scored.ppl(4) == pytest.approx(16)
    assert scored.ppl(3, 9) is None and scored.ppl(0, 2) is None


def test_rows_show_final_span_and_relative_perplexities():
    sizes = ppl.PplSizes(tokens=9, sinks=1, window=3, chunk=2, reference_span=(1, 5), tail=4, bucket=3)
    runs = [run("recompute", [math.log(10)] * 8, 4.0), run("streaming", [math.log(10)] * 4 + [math.log(20)] * 4)]
    recompute, streaming = ppl.summary_rows(runs, sizes)
    assert recompute == {
        "policy": "recompute",
        "cache": "4, recomputed",
        "tokens": 9,
        "ppl": pytest.approx(10),
        "ppl_reference": pytest.approx(10),
        "ppl_tail": pytest.approx(10),
        "tail_vs_reference": pytest.approx(1),
        "vs_recompute": pytest.approx(1),
        "seconds": 4.0,
        "tokens_per_second": pytest.approx(9 / 4),
    }
    assert streaming["cache"] == "1+3"
    assert streaming["ppl_tail"] == pytest.approx(20) and streaming["tail_vs_reference"] == pytest.approx(2)
    assert streaming["vs_recompute"] == pytest.approx(math.sqrt(200) / 10)


def test_spans_past_the_end_of_the_text_are_missing():
    rows = ppl.summary_rows([run("dense", [1.0] * 9)], ppl.FULL)
    assert rows[0]["ppl_reference"] is None and rows[0]["tail_vs_reference"] is None


def test_the_curve_holds_bucket_and_running_perplexity_per_policy():
    runs = [run("dense", [math.log(2)] * 4 + [math.log(8)] * 3), run("window", [math.log(4)] * 7)]
    assert ppl.curve_columns(runs) == ["token", "dense_ppl", "dense_running_ppl", "window_ppl", "window_running_ppl"]
    rows = ppl.curve_rows(runs, bucket=4)
    assert [row["token"] for row in rows] == [4, 7]
    assert rows[1]["dense_ppl"] == pytest.approx(8)
    assert rows[1]["dense_running_ppl"] == pytest.approx(math.exp((4 * math.log(2) + 3 * math.log(8)) / 7))
    assert rows[0]["window_ppl"] == rows[1]["window_running_ppl"] == pytest.approx(4)


def test_checks_judge_only_what_the_chosen_policies_can_show():
    rows = [
        {"policy": "dense", "ppl": 30.0, "tail_vs_reference": 3.0},
        {"policy": "window", "ppl": 40.0, "tail_vs_reference": None},
        {"policy": "recompute", "ppl": 19.0, "tail_vs_reference": 1.2},
        {"policy": "streaming", "ppl": 20.0, "tail_vs_reference": 1.44},
        {"policy": "keep", "cache": "60+964", "ppl": 20.5, "tail_vs_reference": 1.4},
    ]
    found = {check.name: (round(check.value, 3), check.met) for check in ppl.checks(rows)}
    assert found == {
        "streaming / recompute PPL": (1.053, False),
        "streaming flatness (last / ref PPL)": (1.44, False),
        "streaming flatness over recompute's (last / ref)": (1.2, False),
        "window / streaming PPL": (2.0, True),
        "keep 60 / streaming PPL, same capacity": (1.025, True),
        "dense degradation (last / ref PPL)": (3.0, True),
    }
    assert ppl.checks([rows[3]]) == [ppl.checks(rows)[1]]


def test_texts_are_read_whole_and_cut_to_the_tokens_asked(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("Hello there. " * 50, encoding="utf-8")
    ids = ppl.first_tokens(ppl.read_text(path), byte_level_tokenizer(), 20, "cpu")
    assert ids.shape == (1, 20) and ids.dtype == torch.long
    with pytest.raises(ConfigError, match="fewer than --tokens 100000; lower --tokens"):
        ppl.first_tokens(ppl.read_text(path), byte_level_tokenizer(), 100_000, "cpu")
    with pytest.raises(ConfigError, match="no such file"):
        ppl.read_text(tmp_path / "missing.txt")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot be read as UTF-8 text"):
        ppl.read_text(tmp_path / "binary.txt")


def test_scoring_can_start_past_a_books_front_matter(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("CONTENTS\nChapter 1 ... 5\n\nChapter 1\nIt was a dark night.", encoding="utf-8")
    assert ppl.read_text(path, "It was") == "It was a dark night."
    with pytest.raises(ConfigError, match="--from 'Once upon': not found in"):
        ppl.read_text(path, "Once upon")
