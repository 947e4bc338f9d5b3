"""The Rich display, rendered into a string: what scrolls up, and what the live area shows."""

import io

from rich.console import Console

from streamchat.generation.events import (
    CacheOccupancy,
    CacheStats,
    Compiled,
    Compiling,
    Evicted,
    PromptProgress,
    PromptSkipped,
    PromptTruncated,
    Replayed,
    TextDelta,
    TurnFinished,
    TurnStats,
)
from streamchat.interface.display import ChatDisplay, reading_line

FULL = CacheStats(sinks_held=4, sink_capacity=4, window_used=40, window_capacity=40, seen=100, evicted=56)
STATS = TurnStats(
    prompt_tokens=10,
    generated_tokens=5,
    prefill_seconds=0.1,
    decode_seconds=0.4,
    time_to_first_token=0.1,
    stop_reason="max_new_tokens",
)


def console(width=60, **options):
    return Console(file=io.StringIO(), width=width, height=20, color_system=None, **options)


def turn_events():
    return [
        PromptTruncated(prompt_tokens=80, visible_tokens=40),
        TextDelta("Hello wor"),
        TextDelta("ld.\nSecond line"),
        Evicted(count=3, first_index=10, last_index=12, text="the old words", stats=FULL),
        CacheOccupancy(FULL, 12.5),
        TextDelta(" ends."),
        TurnFinished("Hello world.\nSecond line ends.", STATS),
    ]


def test_a_turn_scrolls_up_as_plain_text_with_an_eviction_summary():
    screen = console()
    ChatDisplay(screen).show(iter(turn_events()))
    assert screen.file.getvalue() == (
        "⚠ your message is 80 tokens, more than the cache holds: 40 \n"
        "from its beginning were dropped, the model sees the other 40\n"
        "Hello world.\n"
        "Second line ends.\n"
        "⟲ forgot 3 tokens (#10–#12)  the old words\n"
        "5 tokens · 10.0 tok/s · prompt 10 at 100 tok/s · first token\n"
        "0.10 s · length limit\n"
    )


def test_a_long_eviction_summary_shows_where_the_forgotten_text_begins_and_ends():
    screen = console(width=80)
    words = " ".join(f"word{n}" for n in range(60))
    events = [Evicted(count=60, first_index=4, last_index=63, text=words, stats=FULL), TurnFinished("", STATS)]
    ChatDisplay(screen).show(iter(events))
    assert screen.file.getvalue().splitlines()[0] == "⟲ forgot 60 tokens (#4–#63)  word0 word1 word2 … word58 word59"


def test_the_live_area_holds_the_line_being_written_the_last_eviction_and_the_bar():
    screen, live = console(), console(width=80)
    display = ChatDisplay(screen)
    for event in turn_events()[1:5]:
        display.handle(event)
    live.print(display)
    assert live.file.getvalue() == (
        "Second line\n"
        "⟲ forgot 3 tokens  …the old words\n"
        "▓█████████  4 sinks | 40/40 window | 0 free · 100 streamed\n"  # fitted to the 60 columns
    )


def test_piped_mode_shows_only_the_cache_not_the_reply():
    screen = console()
    ChatDisplay(screen, show_text=False).show(iter(turn_events()))
    assert "Hello" not in screen.file.getvalue()
    assert "⟲ forgot 3 tokens" in screen.file.getvalue()


def test_markdown_replies_are_rendered_once_complete():
    screen = console()
    events = [TextDelta("# Title\n\n- one\n- two"), TurnFinished("# Title\n\n- one\n- two", STATS)]
    ChatDisplay(screen, markdown=True).show(iter(events))
    lines = [line.rstrip() for line in screen.file.getvalue().splitlines()]
    assert [line for line in lines if line] == [
        "Title".center(60).rstrip(),
        " • one",
        " • two",
        "5 tokens · 10.0 tok/s · prompt 10 at 100 tok/s · first token",
        "0.10 s · length limit",
    ]


def test_tables_show_text_as_it_is_not_as_markup():
    screen = console()
    ChatDisplay(screen).table("cache", [("sinks", "[INST] <<SYS>>"), ("window", "… [/INST] [/] [bold]")])
    lines = [line.rstrip() for line in screen.file.getvalue().splitlines()]
    assert lines == ["cache", "sinks   [INST] <<SYS>>", "window  … [/INST] [/] [bold]"]


def test_no_color_keeps_the_bar_readable(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    screen = Console(file=io.StringIO(), width=100, force_terminal=True)
    display = ChatDisplay(screen)
    screen.print(display.status_line(FULL, 3.0))
    output = screen.file.getvalue()
    assert "\x1b[3" not in output  # no foreground colours
    assert "▓" in output and "█" in output


def test_colour_terminals_get_coloured_segments():
    screen = Console(file=io.StringIO(), width=100, force_terminal=True, color_system="standard")
    screen.print(ChatDisplay(screen).status_line(FULL, 3.0))
    assert "\x1b[35m▓" in screen.file.getvalue()  # magenta sinks


def test_a_long_paragraph_scrolls_up_before_it_ends():
    screen = console(width=20)
    display = ChatDisplay(screen)
    display.show(iter([TextDelta("word " * 30), TurnFinished("", STATS)]))
    lines = screen.file.getvalue().splitlines()
    assert lines[0].startswith("word word word")
    assert all(len(line) <= 20 for line in lines[:-2])


HOSTILE_DELTAS = ["Look\x1b", "[2J here \x1b]52;c;aGk=", "\x07 and \u202egnp.exe\u202c\n", "second \x9b31m line"]


def test_control_sequences_in_a_reply_are_dimmed_markers_even_when_split_across_deltas():
    screen = Console(file=io.StringIO(), width=80, force_terminal=True, color_system="standard")
    events = [*map(TextDelta, HOSTILE_DELTAS), TurnFinished("".join(HOSTILE_DELTAS), STATS)]
    ChatDisplay(screen).show(iter(events))
    output = screen.file.getvalue()
    assert "\x1b[2J" not in output and "\x1b]" not in output and "\u202e" not in output and "\x9b" not in output
    dim = "\x1b[2m{}\x1b[0m"
    first_line = (
        f"Look{dim.format('␛[2J')} here {dim.format('␛]52;c;aGk=␇')} and "
        f"{dim.format('⟨RLO⟩')}gnp.exe{dim.format('⟨PDF⟩')}"
    )
    assert first_line in output
    assert f"second {dim.format('␛[31m')} line" in output


def test_the_live_line_eviction_previews_tables_notices_and_errors_are_terminal_safe():
    screen, live = console(), console(width=80)
    display = ChatDisplay(screen)
    evicted = Evicted(count=3, first_index=10, last_index=12, text="old \x1b]0;title\x07", stats=FULL)
    display.handle(TextDelta("partial \x1b[2J"))
    display.handle(evicted)
    live.print(display)
    assert live.file.getvalue().splitlines()[:2] == ["partial ␛[2J", "⟲ forgot 3 tokens  …old ␛]0;title␇"]
    display.show(iter([evicted, TurnFinished("", STATS)]))
    display.notice("system prompt: \x1b[2J")
    display.error("unknown command /\x1bc")
    display.table("settings", [("stop", "\x1b[A")])
    output = screen.file.getvalue()
    assert "\x1b" not in output
    assert "⟲ forgot 3 tokens (#10–#12)  old ␛]0;title␇" in output
    assert "system prompt: ␛[2J" in output and "error: unknown command /␛c" in output and "stop  ␛[A" in output


def test_a_long_prompt_read_in_part_gets_one_notice_and_its_progress_shows_in_the_live_area():
    screen, live = console(width=200), console(width=200)
    display = ChatDisplay(screen)
    display.handle(PromptSkipped(250_030, 4_004, "too_long"))
    display.handle(PromptTruncated(prompt_tokens=250_030, visible_tokens=2_004))  # already said
    display.handle(PromptProgress(2_000, 4_004, 500.0))
    live.print(display)
    assert screen.file.getvalue() == (
        "read the last 4,004 of 250,030 prompt tokens; the model could not have seen the rest; "
        "--read-all streams all of it\n"
    )
    assert live.file.getvalue() == "reading your message: 2,000/4,004 tokens · 500 tok/s · 4 s left · Ctrl-C stops\n"
    display.handle(PromptProgress(4_000, 250_030, 400.0))
    assert reading_line(display._reading) == (
        "reading your message: 4,000/250,030 tokens · 400 tok/s · 10 min 15 s left · Ctrl-C stops"
    )
    display.handle(TextDelta("The"))  # the reply starts: the read is over
    assert display._reading is None


def test_a_replay_shows_its_progress_over_the_emptied_cache_then_one_line():
    live = console(width=100)
    display = ChatDisplay(console(width=100))
    display.handle(CacheOccupancy(FULL, 3.0))  # the last turn's bar
    empty = CacheStats(sinks_held=0, sink_capacity=4, window_used=0, window_capacity=40, seen=0, evicted=0)
    display.handle(CacheOccupancy(empty, 0.0))
    display.handle(PromptProgress(0, 4_044, 0.0, "conversation"))
    live.print(display)
    assert live.file.getvalue() == (
        "replaying the conversation: 0/4,044 tokens\n"
        + "░" * 40
        + "  0 sinks | 0/40 window | 44 free · 0 streamed · 0 evicted\n"
    )
    display.handle(PromptProgress(1_024, 4_044, 512.0, "conversation"))
    assert reading_line(display._reading) == "replaying the conversation: 1,024/4,044 tokens · 512 tok/s · 6 s left"
    screen = console(width=200)
    ChatDisplay(screen).show(iter([PromptProgress(4_044, 4_044, 500.0, "conversation"), Replayed(12, 4_044)]))
    assert screen.file.getvalue() == "replayed 12 messages (4,044 tokens)\n"


def test_a_read_stopped_by_ctrl_c_says_how_much_the_model_saw():
    screen = console(width=200)
    ChatDisplay(screen).show(iter([PromptSkipped(9_000, 1_024, "stopped"), TurnFinished("", STATS)]))
    assert screen.file.getvalue().splitlines()[0] == (
        "stopped reading your message after 1,024 of 9,000 tokens; the model saw only that part"
    )


def test_a_first_compile_is_announced_before_it_blocks_and_timed_after():
    screen = console(width=80)
    ChatDisplay(screen).show(iter([Compiling(), Compiled(41.26), TextDelta("Hi."), TurnFinished("Hi.", STATS)]))
    assert screen.file.getvalue().splitlines()[:3] == [
        "compiling the decode step (once per start; later starts reuse the cache)…",
        "decode step compiled in 41.3 s",
        "Hi.",
    ]


def test_a_recall_is_one_line_naming_its_turns():
    from streamchat.generation.events import Recalled
    from streamchat.interface.display import recalled_text

    assert recalled_text(Recalled(2, (3, 7), 41)) == "↺ recalled 2 passages from turns 3 and 7 (41 tokens)"
    assert recalled_text(Recalled(1, (2,), 9)) == "↺ recalled 1 passage from turn 2 (9 tokens)"
    assert recalled_text(Recalled(3, (1, 2, 5), 60)) == "↺ recalled 3 passages from turns 1, 2 and 5 (60 tokens)"
