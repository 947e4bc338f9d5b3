"""A reply's draws, a step at a time in an engine: compiled steps equal eager ones, one graph, no recompiles;
take_back is exact; a token fed before the host reads it settles as one read first."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.compiled_decode import compile_backend
from streamchat.errors import ConfigError
from streamchat.generation.decoder import Decoder, _Reader
from streamchat.generation.requests import endless_reply
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from tests.support.models import VOCAB, tiny_model
from tests.support.reference_sampling import apply_openai_penalties

SINKS, WINDOW, PROMPT, STEPS = 4, 60, 20, 300
SAMPLED = GenerationSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.3, max_new_tokens=STEPS)


def stream(model, backend: str | None, settings: GenerationSettings) -> list[int]:
    """STEPS tokens decoded after a random prompt through 4 + 60 slots: evictions from step 40, rebases."""
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(cache)
    decoder.start(forward(model, cache, prompt).logits, settings, Sampler(seed=11))
    next_token = endless_reply(model, decoder, backend)
    tokens = [next_token().token for _ in range(STEPS)]
    assert cache.stats().evicted == PROMPT + STEPS - SINKS - WINDOW
    assert cache.ledger.position_offset > 0  # rebased on the way
    return tokens


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("settings", [GenerationSettings(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_a_compiled_decode_step_is_one_graph_that_never_recompiles_and_matches_eager(model_type, settings):
    model = tiny_model(model_type)
    eager = stream(model, None, settings)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = stream(model, "aot_eager", settings)  # fullgraph=True: a graph break would raise
    assert compiled == eager
    assert len(set(eager)) > 2  # a real stream, not one token repeated


@pytest.mark.parametrize(
    "greedy",
    [
        GenerationSettings(temperature=0.0),
        GenerationSettings(temperature=0.0, frequency_penalty=0.3, presence_penalty=1.0),
    ],
    ids=["plain", "penalized"],  # a token taken back no longer counts as drawn
)
def test_a_step_taken_back_leaves_the_stream_as_if_it_never_happened(greedy):
    model = tiny_model("gemma2")  # sliding layers take the step back too
    straight = stream(model, None, greedy)
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(cache)
    decoder.start(forward(model, cache, prompt).logits, greedy, Sampler(seed=11))
    next_token = endless_reply(model, decoder)
    tokens = []
    for index in range(STEPS):
        token = next_token().token
        if index % 37 == 36:
            decoder.take_back()
            assert next_token().token == token
        tokens.append(token)
    assert tokens == straight


def test_each_token_comes_with_what_feeding_it_evicted():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(cache)
    fed = forward(model, cache, prompt)
    assert fed.eviction is None
    decoder.start(fed.logits, GenerationSettings(temperature=0.0), Sampler(seed=11))
    next_token = endless_reply(model, decoder)
    evictions = [next_token().eviction for _ in range(100)]
    # The window fills with the 44th reply token; from then on each token evicts the oldest one.
    assert evictions[:44] == [None] * 44
    assert [(e.count, e.first_index, e.last_index) for e in evictions[44:]] == [(1, i, i) for i in range(4, 60)]
    assert cache.stats().evicted == 56


@pytest.mark.parametrize(
    ("setting", "device", "backend"),
    [
        ("auto", "cuda", "inductor"),
        ("auto", "cpu", None),
        ("auto", "mps", None),
        ("on", "cpu", "inductor"),
        ("off", "cuda", None),
    ],
)
def test_compile_auto_means_on_for_cuda_only(setting, device, backend):
    assert compile_backend(setting, torch.device(device)) == backend


def test_an_unknown_compile_setting_is_refused_by_name():
    with pytest.raises(ConfigError, match="--compile 'yes': choose one of auto, on, off"):
        compile_backend("yes", torch.device("cpu"))


def test_a_step_taken_back_where_positions_rebase_leaves_every_stored_key_as_if_it_never_happened():
    model = tiny_model("llama")
    greedy = GenerationSettings(temperature=0.0)

    def decoded(take_back_at: set[int]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The cache after 130 steps, with the steps in `take_back_at` taken back and fed again; the rebase steps."""
        cache = SinkCache.for_model(model, SINKS, WINDOW)
        prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
        decoder = Decoder(cache)
        decoder.start(forward(model, cache, prompt).logits, greedy, Sampler(seed=11))
        next_token = endless_reply(model, decoder)
        rebases = []
        for index in range(130):
            offset = cache.ledger.position_offset
            next_token()
            if index in take_back_at:
                decoder.take_back()
                next_token()
            if cache.ledger.position_offset != offset:
                rebases.append(index)
        return CacheSnapshot.whole(cache).tensors(), rebases

    straight, rebases = decoded(set())
    assert rebases  # the stream crosses a rebase
    taken_back, _ = decoded({step + delta for step in rebases for delta in (-1, 0, 1)})
    assert straight.keys() == taken_back.keys()
    assert [name for name in straight if not torch.equal(straight[name], taken_back[name])] == []


def reference_greedy(model, frequency: float, presence: float, steps: int = 40) -> tuple[list[int], float]:
    """A greedy reply by the reference: one token at a time through forward(), OpenAI's penalties over the
    reply's own ids, argmax; and the widest spread (highest less lowest logit) of any step's logits."""
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    logits = forward(model, cache, prompt).logits[0, -1].float()
    reply, spread = [], 0.0
    for _ in range(steps):
        spread = max(spread, float(logits.max() - logits.min()))
        reply.append(int(apply_openai_penalties(logits, reply, frequency, presence).argmax()))
        logits = forward(model, cache, torch.tensor([reply[-1:]])).logits[0, -1].float()
    return reply, spread


def greedy_reply(model, frequency: float, presence: float, steps: int = 40) -> list[int]:
    """The decoder's greedy reply after the same prompt, within the window (no eviction)."""
    settings = GenerationSettings(temperature=0.0, frequency_penalty=frequency, presence_penalty=presence)
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(cache, vocab_size=VOCAB)
    decoder.start(forward(model, cache, prompt).logits, settings, Sampler(seed=11))
    next_token = endless_reply(model, decoder)
    return [next_token().token for _ in range(steps)]


@pytest.mark.parametrize(("frequency", "presence"), [(0.5, 1.0), (2.0, 0.0), (0.0, -2.0), (-0.3, 0.2)])
def test_greedy_decoding_with_the_penalties_is_the_argmax_of_the_reference_step_by_step(frequency, presence):
    model = tiny_model("llama")
    expected, _ = reference_greedy(model, frequency, presence)
    assert greedy_reply(model, frequency, presence) == expected
    assert expected != reference_greedy(model, 0.0, 0.0)[0]  # the penalties changed the reply


def flat_model():
    """The tiny llama with its logits scaled down, so that no step's logits spread over 2 (checked below)."""
    model = copy.deepcopy(tiny_model("llama"))  # tiny_model's models are shared
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)
    return model


def test_a_presence_penalty_of_2_past_the_logits_spread_never_repeats_a_token_of_the_reply():
    model = flat_model()
    plain, _ = reference_greedy(model, 0.0, 0.0)
    assert len(set(plain)) < len(plain)  # greedy alone repeats itself
    penalized = greedy_reply(model, 0.0, 2.0)
    _, spread = reference_greedy(model, 0.0, 2.0)
    assert spread < 2.0  # so any token not drawn yet beats every token drawn
    assert len(set(penalized)) == len(penalized)
    assert penalized[0] == plain[0]  # nothing is counted before the reply's first token


def test_a_presence_penalty_of_minus_2_past_the_logits_spread_repeats_the_first_token():
    model = flat_model()
    reply = greedy_reply(model, 0.0, -2.0)
    _, spread = reference_greedy(model, 0.0, -2.0)
    assert spread < 2.0  # so the first token, raised by 2, stays above every other
    assert reply == [reply[0]] * len(reply)


class _LateReader(_Reader):
    """The CUDA order on the CPU: the token is fed before the host reads it (draw()'s asynchronous path)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.asynchronous = True

    def send(self, drawn) -> None:
        self._values = torch.cat((drawn.token.reshape(1), drawn.settled.reshape(1).long()))

    def receive(self) -> tuple[int, bool]:
        token, settled = self._values.tolist()
        return token, bool(settled)


@pytest.mark.parametrize("late", [False, True], ids=["read_first", "fed_first"])
def test_the_cache_records_every_decoded_token_with_the_replys_label_whether_read_before_or_after_its_step(late):
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(cache)
    if late:
        decoder._reader = _LateReader()
    decoder.start(forward(model, cache, prompt, label=0).logits, SAMPLED, Sampler(seed=11), label=1)
    next_token = endless_reply(model, decoder)
    tokens, evicted = [], []
    for _ in range(100):
        decoded = next_token()
        tokens.append(decoded.token)
        evicted += decoded.eviction.token_ids if decoded.eviction is not None else ()
    held = cache.held_tokens()
    ids = prompt[0].tolist() + tokens
    assert held.token_ids == ids[:SINKS] + ids[-WINDOW:]
    assert held.window_labels == (1,) * WINDOW and held.sink_labels == (0,) * SINKS
    assert evicted == ids[SINKS:-WINDOW]
    # Most of these draws' shortlists cannot decide (top-p 0.9 over flat logits): fed first, each guess's step is
    # taken back and the token drawn again fed; the same tokens either way.
    assert tokens == stream(model, None, SAMPLED)[:100]
