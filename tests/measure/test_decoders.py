"""One decode step per policy, on a tiny model: what each step does to its cache, and what it computes."""

import torch

from streamchat.generation.settings import GenerationSettings
from streamchat.measure.decoders import DenseDecoder, RecomputeDecoder, StreamingDecoder
from tests.support.models import VOCAB, tiny_model

SETTINGS = GenerationSettings()


def stream(length: int) -> torch.Tensor:
    return torch.randint(VOCAB, (1, length), generator=torch.Generator().manual_seed(1))


def test_a_streaming_step_is_the_engines_decode_step():
    decoder = StreamingDecoder(tiny_model(), sinks=4, window=28, settings=SETTINGS, seed=0)
    with torch.inference_mode():
        decoder.feed(stream(40))
        assert (decoder.seen, decoder.fill) == (40, 32)
        for _ in range(3):
            decoder.step()
            decoder.rewind()
    assert (decoder.seen, decoder.fill, decoder.cache.stats().evicted) == (43, 32, 11)
    assert decoder.logits.shape == (1, 1, VOCAB)


def test_dense_steps_keep_the_fill_and_give_what_a_fresh_cache_gives():
    model, ids = tiny_model(), stream(30)
    decoder = DenseDecoder(model, SETTINGS, seed=0)
    with torch.inference_mode():
        decoder.extend(ids[:, :20])
        for _ in range(3):
            decoder.step()
            decoder.rewind()
        assert decoder.fill == 20
        decoder.extend(ids[:, 20:30])
        expected = model(input_ids=ids, use_cache=False).logits[:, -1:]
    assert decoder.fill == 30
    torch.testing.assert_close(decoder.logits, expected, atol=1e-5, rtol=1e-5)


def test_recompute_slides_its_window_one_token_per_step():
    model, ids = tiny_model(), stream(12)
    decoder = RecomputeDecoder(model, SETTINGS, seed=0)
    with torch.inference_mode():
        decoder.start(ids, model(input_ids=ids).logits[:, -1:])
        decoder.step()
        expected = model(input_ids=decoder.context, use_cache=False).logits[:, -1:]
    assert decoder.fill == 12 and torch.equal(decoder.context[:, :-1], ids[:, 1:])
    torch.testing.assert_close(decoder.logits, expected)
