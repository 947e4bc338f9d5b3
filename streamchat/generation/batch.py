"""Several conversations' replies decoded together: one forward pass a step for every reply in the batch.

    batch = DecodeBatch(model)
    # in each conversation's token loop (TokenLoop.decode, when its session decodes in a batch):
    decoded = yield from batch.next(decoder, stop_requested)   # DecodeQueued until its step ran
    batch.leave(decoder)                                       # its reply ended
    # whoever takes turns between the conversations (the server's worker), after each round:
    if batch.ready():
        batch.run()

Decoding is bound by reading the weights, so a step for eight conversations costs little
more than a step for one. Each row draws its own token, from its own logits, with its own
settings and seeded sampler, exactly as its Decoder does alone; the batch only feeds the
tokens together (streamchat.cache.batch: each cache a row of one pooled allocation, its
own ledgers planning its step). Rows join when their reply's first token is fed and
leave when the reply ends, between steps (continuous batching); a step runs once every
row in the batch has queued its token, so a reply never gets ahead of the others.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from streamchat.cache.batch import BatchStep, CacheBatch
from streamchat.cache.ledger import Eviction
from streamchat.generation.decoder import Decoded, Decoder
from streamchat.generation.events import DecodeQueued
from streamchat.generation.sampling import Settled
from streamchat.placement.lean_forward import lean_forward_for


class DecodeBatch:
    """The replies decoding together over one model, and the steps that feed them."""

    def __init__(self, model: Any, fixed_rows: bool = False) -> None:
        self.model = model
        # The llama family's written-out step where the model has fused layers, as a one-row decoder takes.
        self._lean = lean_forward_for(model)
        self.caches = CacheBatch(fixed_rows)
        self._decoders: dict[int, Decoder] = {}  # id(cache) -> the decoder of each cache in the batch
        self._queued: dict[Decoder, Settled] = {}
        self._fed: dict[Decoder, Eviction | BaseException | None] = {}
        self.steps = 0  # batched steps run
        self.rows_fed = 0  # tokens they fed

    @property
    def members(self) -> list[Decoder]:
        """The decoders in the batch, in row order."""
        return [self._decoders[id(cache)] for cache in self.caches.members]

    def next(self, decoder: Decoder, stop_requested: bool = False) -> Generator[DecodeQueued, None, Decoded | None]:
        """Decoder.next() in the batch: the token drawn and fed (DecodeQueued until then); None on stop()."""
        if stop_requested:
            return None
        settled = decoder.draw()
        if not decoder.cache.ledger.sinks_full:
            # A conversation shorter than its sinks: fed alone (a decode step needs the sinks filled).
            eviction = decoder.feed(settled.on_device)
            yield DecodeQueued()
            return Decoded(settled.token, eviction)
        self._queued[decoder] = settled
        yield DecodeQueued()
        while decoder not in self._fed:
            if self.ready():
                self.run()  # nobody ran the step between two turns of this generator: run it here
            else:
                yield DecodeQueued()
        fed = self._fed.pop(decoder)
        if isinstance(fed, BaseException):
            raise fed
        return Decoded(settled.token, fed)

    def ready(self) -> bool:
        """Whether a step can run: some token queued, and every row in the batch has queued one."""
        return bool(self._queued) and all(decoder in self._queued for decoder in self.members)

    def run(self) -> None:
        """Feed every queued token in one forward pass; each decoder gets its row's logits and eviction.

        A failure (out of memory, a bug) fails every row of the step: each of their next() raises it.
        """
        queued, self._queued = self._queued, {}
        try:
            for decoder in queued:
                if decoder.cache not in self.caches:
                    self.caches.join(decoder.cache)
                    self._decoders[id(decoder.cache)] = decoder
            members = self.members
            for decoder in members:
                decoder.checkpoint()
            with self.caches.decode_step([queued[decoder].on_device for decoder in members]) as step:
                logits = self._forward(step)  # [rows, 1, vocab]
                for row, decoder in enumerate(members):
                    decoder.fed(logits[row : row + 1])
        except Exception as error:  # every row's turn hears of it; the batch goes on without them
            for decoder in queued:
                self._fed[decoder] = error
            return
        self.steps += 1
        self.rows_fed += len(members)
        self._fed.update(zip(members, step.evictions, strict=True))

    def _forward(self, step: BatchStep) -> torch.Tensor:
        inputs = step.inputs
        if self._lean is not None:
            return self._lean(step.input_ids, inputs.position_ids, inputs.attention_mask, self.caches)
        return self.model(
            input_ids=step.input_ids,
            cache=self.caches,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            use_cache=True,
            logits_to_keep=1,
        ).logits

    def leave(self, decoder: Decoder) -> None:
        """`decoder`'s reply ended: its cache owns its storage again (taken out between steps)."""
        self._queued.pop(decoder, None)
        self._fed.pop(decoder, None)
        cache = decoder.cache
        if self._decoders.get(id(cache)) is decoder:
            with torch.inference_mode():
                self.caches.leave(cache)
            del self._decoders[id(cache)]
