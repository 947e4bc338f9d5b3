"""What --keep keeps: the first tokens of a conversation, held in the cache forever as its sinks.

- `system` (the default): every token from the start of the conversation through the end
  of the system turn, whatever the template writes there (a BOS, the role markers, a
  default system prompt such as SmolLM2's), so that the model never forgets its
  instructions. Never fewer than the paper's 4: without a system turn the model still
  needs first tokens to park its attention on.
- a number N: the first N tokens, whatever they are. `--keep 4` is StreamingLLM's plain
  behaviour, where a long chat scrolls the system prompt out of the window.

The kept tokens are the sink cache's sinks (streamchat.cache), positioned exactly like
them. How many there are is fixed when a cache is made, so a new system prompt gets a
new cache.

A kept prefix longer than the window is refused: the instructions would take more room
than the conversation they govern, and the cache (kept + window) would grow past twice
the window the user chose for memory and speed.
"""

from __future__ import annotations

from streamchat import defaults
from streamchat.conversation.template import ChatFormat, common_prefix_length
from streamchat.errors import ConfigError

Keep = str | int  # defaults.KEEP_SYSTEM, or a number of first tokens

# First messages that begin with different tokens: where their first turns stop agreeing, the
# user's text has begun, so the system turn ended no later.
_PROBES = ("Hi", "42", "東京")


def parse_keep(value: object) -> Keep:
    """`system` or a whole number >= 0 (also as text); ConfigError otherwise."""
    if value == defaults.KEEP_SYSTEM:
        return defaults.KEEP_SYSTEM
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise _bad_keep(value)


def system_turn_length(chat_format: ChatFormat) -> int:
    """Tokens from the start of a conversation through the end of its system turn (0 without one).

    The first turn is the system turn followed by a user turn. Two ways bound where the
    user turn starts, and the system turn ends where the first of them says:
    - first turns with different messages agree up to the user's text, role marker included;
    - a first turn ends with the same tokens as a later turn with the same message, at least
      from the user's role marker on (ChatML, the fallback format), though sometimes only
      from within the text (Llama 2 puts the system prompt inside the first [INST]).
    """
    firsts = [chat_format.prompt_ids(probe, first_turn=True) for probe in _PROBES]
    later = chat_format.prompt_ids(_PROBES[0], first_turn=False)
    before_the_text = min(common_prefix_length(firsts[0], other) for other in firsts[1:])
    shared_ending = common_prefix_length(firsts[0][::-1], later[::-1])
    return min(before_the_text, len(firsts[0]) - shared_ending)


def kept_tokens(chat_format: ChatFormat, keep: Keep, window: int) -> int:
    """How many first tokens the cache keeps for a conversation in `chat_format`; ConfigError past the window."""
    if keep != defaults.KEEP_SYSTEM:
        if isinstance(keep, str):  # parse_keep() turns a number given as text into an int
            raise _bad_keep(keep)
        if keep > window:
            raise ConfigError(f"--keep {keep} is more than the {window:,}-token window; keep at most {window:,}")
        return keep
    length = system_turn_length(chat_format)
    if length > window:
        raise ConfigError(
            f"the system turn is {length:,} tokens, longer than the {window:,}-token window: shorten the system "
            "prompt, raise --window, or use --keep 4 to let it scroll away with the conversation"
        )
    return max(length, defaults.SINKS)


def _bad_keep(value: object) -> ConfigError:
    return ConfigError(f"keep must be '{defaults.KEEP_SYSTEM}' or a whole number of first tokens >= 0, got {value!r}")
