"""One decode step under each policy the speed benchmark compares.

Every step is what the chat engine does per generated token (TokenLoop.decode and
feed): sample the next token from the last logits with the session's Sampler, then
feed it in one forward pass that keeps only the last position's logits. Only the
cache differs:

- StreamingDecoder: the sink cache, through the engine's own token loop
  (`streamchat.generation.decoder.Decoder`: draw, feed, read back);
- DenseDecoder: a DynamicCache (transformers' default) holding a fixed number of tokens;
- RecomputeDecoder: no cache, each token re-reads the last `fill` tokens in one forward pass.

`step()` is what gets timed; `rewind()` runs after it, untimed, to keep a decoder's fill
constant across steps. Callers run all of it under torch.inference_mode().
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.generation.decoder import Decoder
from streamchat.generation.requests import endless_reply, read_prompt
from streamchat.generation.sampling import Sampler, make_draw
from streamchat.generation.settings import GenerationSettings


class PolicyDecoder(Protocol):
    def step(self) -> None: ...

    def rewind(self) -> None: ...


class _Sampling:
    """The sampling half of a decode step, shared by all policies."""

    def __init__(self, model: Any, settings: GenerationSettings, seed: int) -> None:
        self.model = model
        self.settings = settings
        self.sampler = Sampler(seed)
        self.draw = make_draw(settings, self.sampler)
        self.device = model.get_input_embeddings().weight.device
        self.logits: torch.Tensor | None = None  # [1, 1, vocab] after the last token fed

    def last_logits(self) -> torch.Tensor:
        """The logits [1, 1, vocab] after the last token fed."""
        if self.logits is None:
            raise RuntimeError(f"{type(self).__name__}: no token fed yet")
        return self.logits

    def next_input(self) -> torch.Tensor:
        """The sampled next token as input ids [1, 1]."""
        token = self.draw.next_token(self.last_logits()[0, -1])
        return torch.tensor([[token]], device=self.device)

    def rewind(self) -> None:
        pass


class StreamingDecoder(_Sampling):
    def __init__(
        self,
        model: Any,
        sinks: int,
        window: int,
        settings: GenerationSettings,
        seed: int,
        compile_backend: str | None = None,
    ) -> None:
        super().__init__(model, settings, seed)
        self.cache = SinkCache.for_model(model, sinks, window)
        self.decoder = Decoder(self.cache)
        self.compile_backend = compile_backend
        self._step: Callable[[], object] | None = None

    @property
    def fill(self) -> int:
        return self.cache.stats().used

    @property
    def seen(self) -> int:
        return self.cache.stats().seen

    def feed(self, input_ids: torch.Tensor) -> None:
        """Stream ids [1, n] through the cache as the chat reads a prompt: in prefill chunks, in the engine's steps."""
        self.logits = read_prompt(self.model, self.cache, input_ids[0].tolist())
        self.decoder.start(self.logits, self.settings, self.sampler)
        self._step = endless_reply(self.model, self.decoder, self.compile_backend)

    def step(self) -> None:
        if self._step is None:
            raise RuntimeError("StreamingDecoder: no prompt fed yet")
        self._step()


class DenseDecoder(_Sampling):
    """A DynamicCache filled once; each step's token is taken back out, so every step sees the same fill."""

    def __init__(self, model: Any, settings: GenerationSettings, seed: int) -> None:
        super().__init__(model, settings, seed)
        self.cache = DynamicCache(config=model.config)
        self._filled: list[dict[str, Any]] = []

    @property
    def fill(self) -> int:
        return self.cache.get_seq_length()

    def extend(self, input_ids: torch.Tensor) -> None:
        """Append ids [1, n] to the cache, positions growing, in prefill chunks."""
        for start in range(0, input_ids.shape[-1], defaults.PREFILL_CHUNK):
            chunk = input_ids[:, start : start + defaults.PREFILL_CHUNK]
            self.logits = self.model(input_ids=chunk, cache=self.cache, use_cache=True, logits_to_keep=1).logits
        # Dynamic layers replace their tensors on update (torch.cat) rather than writing into
        # them, so keeping the attributes is enough to undo a step later, with no copy.
        self._filled = [dict(vars(layer)) for layer in self.cache.layers]

    def step(self) -> None:
        self.logits = self.model(input_ids=self.next_input(), cache=self.cache, use_cache=True, logits_to_keep=1).logits

    def rewind(self) -> None:
        for layer, state in zip(self.cache.layers, self._filled, strict=True):
            vars(layer).update(state)


class RecomputeDecoder(_Sampling):
    """Sliding window with recomputation: each token costs one forward pass over the window."""

    def __init__(self, model: Any, settings: GenerationSettings, seed: int) -> None:
        super().__init__(model, settings, seed)
        self.context: torch.Tensor | None = None  # ids [1, fill]

    @property
    def fill(self) -> int:
        return 0 if self.context is None else self.context.shape[-1]

    def start(self, context: torch.Tensor, logits: torch.Tensor) -> None:
        """Recompute over ids [1, fill] from now on, starting from logits [1, 1, vocab] already known."""
        self.context, self.logits = context, logits

    def step(self) -> None:
        if self.context is None:
            raise RuntimeError("RecomputeDecoder: not started")
        # The window slides: the oldest token leaves as the new one comes, so the fill stays.
        self.context = torch.cat((self.context[:, 1:], self.next_input()), dim=1)
        self.logits = self.model(input_ids=self.context, use_cache=False, logits_to_keep=1).logits
