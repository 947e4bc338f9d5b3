"""The token loop: compiled decode steps equal eager ones, one graph, no recompiles; take_back is exact."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import cache_state
from streamchat.errors import ConfigError
from streamchat.generation.decoder import Decoder, compile_backend
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from tests.support.models import VOCAB, tiny_model

SINKS, WINDOW, PROMPT, STEPS = 4, 60, 20, 300
SAMPLED = GenerationSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.3, max_new_tokens=STEPS)


def stream(model, backend: str | None, settings: GenerationSettings) -> list[int]:
    """STEPS tokens decoded after a random prompt through 4 + 60 slots: evictions from step 40, rebases."""
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(model, cache, compile_backend=backend)
    decoder.start(forward(model, cache, prompt).logits, settings, Sampler(seed=11))
    tokens = [decoder.next().token for _ in range(STEPS)]
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


def test_a_step_taken_back_leaves_the_stream_as_if_it_never_happened():
    model = tiny_model("gemma2")  # sliding layers take the step back too
    greedy = GenerationSettings(temperature=0.0)
    straight = stream(model, None, greedy)
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(model, cache)
    decoder.start(forward(model, cache, prompt).logits, greedy, Sampler(seed=11))
    tokens = []
    for step in range(STEPS):
        token = decoder.next().token
        if step % 37 == 36:
            decoder.take_back()
            assert decoder.next().token == token
        tokens.append(token)
    assert tokens == straight


def test_each_token_comes_with_what_feeding_it_evicted():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder = Decoder(model, cache)
    fed = forward(model, cache, prompt)
    assert fed.eviction is None
    decoder.start(fed.logits, GenerationSettings(temperature=0.0), Sampler(seed=11))
    evictions = [decoder.next().eviction for _ in range(100)]
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


def test_a_stop_requested_before_a_step_feeds_nothing_and_returns_none():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, 4, 30)
    decoder = Decoder(model, cache)
    logits = forward(model, cache, torch.tensor([[1, 5, 9]])).logits
    decoder.start(logits, GenerationSettings(temperature=0.0), Sampler(0))
    seen = cache.stats().seen
    assert decoder.next(stop_requested=True) is None
    assert cache.stats().seen == seen
    assert decoder.next().token == int(logits[0, -1].argmax())


def test_a_step_taken_back_where_positions_rebase_leaves_every_stored_key_as_if_it_never_happened():
    model = tiny_model("llama")
    greedy = GenerationSettings(temperature=0.0)

    def decoded(take_back_at: set[int]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The cache after 130 steps, with the steps in `take_back_at` taken back and fed again; the rebase steps."""
        cache = SinkCache.for_model(model, SINKS, WINDOW)
        prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
        decoder = Decoder(model, cache)
        decoder.start(forward(model, cache, prompt).logits, greedy, Sampler(seed=11))
        rebases = []
        for step in range(130):
            offset = cache.ledger.position_offset
            decoder.next()
            if step in take_back_at:
                decoder.take_back()
                decoder.next()
            if cache.ledger.position_offset != offset:
                rebases.append(step)
        return cache_state(cache), rebases

    straight, rebases = decoded(set())
    assert rebases  # the stream crosses a rebase
    taken_back, _ = decoded({step + delta for step in rebases for delta in (-1, 0, 1)})
    assert straight.keys() == taken_back.keys()
    assert [name for name in straight if not torch.equal(straight[name], taken_back[name])] == []
