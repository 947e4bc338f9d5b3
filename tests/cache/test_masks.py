import torch

from streamchat.cache import masks


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
