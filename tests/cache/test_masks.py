import torch

from streamchat.cache import masks
from streamchat.cache.ledger import SlidingLedger, StreamLedger
from streamchat.cache.masks import Occupancy, slot_index


def test_one_kind_of_layer_takes_one_mask_and_mixed_kinds_a_mask_per_layer_type():
    full, sliding = torch.ones(1, 1, 1, 4, dtype=torch.bool), torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    assert masks.per_layer_type(full, None, {"full_attention": False}) is full
    assert masks.per_layer_type(full, sliding, {"sliding_attention": True}) is sliding
    mixed = masks.per_layer_type(full, sliding, {"sliding_attention": True, "full_attention": False})
    assert mixed == {"sliding_attention": sliding, "full_attention": full}


def test_a_boolean_mask_becomes_4d_or_terms_added_to_the_scores():
    held = torch.tensor([[True, False]])
    assert torch.equal(masks.for_attention(held, True, torch.float32), held[None, None])
    added = masks.for_attention(held, False, torch.bfloat16)
    assert added.dtype == torch.bfloat16 and added.tolist() == [[[[0.0, torch.finfo(torch.bfloat16).min]]]]


def occupied(sinks: int, window: int, fed: int, sliding_window: int | None = None):
    """The occupancy of ledgers that took `fed` tokens in one pass (no room needed), and their placements."""
    ledger = StreamLedger(sinks, window)
    sliding = None if sliding_window is None else SlidingLedger(sliding_window)
    placement = ledger.place(fed)
    sliding_placement = None if sliding is None else sliding.place(fed)
    occupancy = Occupancy(ledger.slots, 0 if sliding is None else sliding.slots, torch.device("cpu"))
    occupancy.sync(ledger, sliding)
    return occupancy, placement, sliding_placement


def test_a_chunk_sees_what_is_held_and_its_own_tokens_causally():
    occupancy, placement, _ = occupied(sinks=2, window=6, fed=3)
    new_slots = slot_index([placement.sink_slots, (2, 3)], torch.device("cpu"))  # two sinks, then ring slot 0
    full, sliding = occupancy.pass_masks(placement, None, new_slots, 0)
    assert sliding is None
    assert full.tolist() == [[True, False, False], [True, True, False], [True, True, True]]  # slots 0..2 written


def test_one_token_sees_every_held_slot_and_a_sliding_chunk_a_band_of_the_last_tokens():
    occupancy, placement, sliding = occupied(sinks=1, window=6, fed=1, sliding_window=3)
    full, sliding_mask = occupancy.pass_masks(placement, sliding, torch.tensor([0]), 3)
    assert full.tolist() == [True] and sliding_mask.tolist() == [True]
    occupancy, placement, sliding = occupied(sinks=1, window=6, fed=4, sliding_window=3)
    _, band = occupancy.pass_masks(placement, sliding, torch.tensor([0, 1, 2, 3]), 3)
    # No old tokens kept: each of the 4 queries sees itself and the two before it.
    assert band.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [False, True, True, True],
    ]


def test_a_decode_pass_sends_its_position_shift_and_slots():
    occupancy, _, _ = occupied(sinks=1, window=4, fed=1, sliding_window=2)
    sliding = SlidingLedger(2)
    sliding.place(2)
    sliding_placement = sliding.place(1)  # the ring is full: its oldest slot is freed for the new token
    occupancy.send_decode(position=9, sink_shift=4, write=3, freed=2, sliding=sliding_placement)
    assert occupancy.scalars.tolist() == [9, 4, 3, 2, sliding_placement.runs[0][0], sliding_placement.freed[0][0]]
    occupancy.send_decode(position=10, sink_shift=4, write=4, freed=None, sliding=None)
    assert occupancy.scalars.tolist()[:4] == [10, 4, 4, 4]  # nothing freed: the written slot stands for it
