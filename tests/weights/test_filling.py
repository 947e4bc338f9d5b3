from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from streamchat.placement.fusion import fuse_projections
from streamchat.placement.int4_linear import GridLinear
from streamchat.weights.filling import empty_model, fill_model, missing_tensors
from streamchat.weights.sources import SafetensorsSource, SourceTensor
from tests.support.gguf_files import save_model_directory, write_tiny_gguf


class Recording:
    """A source that notes what it reads, and when a layer is finished."""

    def __init__(self, source: SafetensorsSource, events: list[str]) -> None:
        self.source, self.events = source, events

    def names(self):
        return self.source.names()

    def read(self, name: str) -> SourceTensor:
        self.events.append(name)
        return self.source.read(name)


def test_a_filled_model_equals_the_one_transformers_loads(tmp_path: Path):
    directory = save_model_directory(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "model")
    config = AutoConfig.from_pretrained(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model = empty_model(config, torch.float32, "sdpa")
    source = SafetensorsSource(directory)
    assert missing_tensors(model, source) == []
    fuse_projections(model)  # filled in the layout it runs in: q/k/v read into one layer
    fill_model(model, source, torch.float32, torch.device("cpu"), finish=lambda scope: None)

    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as in the config


def test_each_layer_is_finished_before_the_next_is_read(tmp_path: Path):
    directory = save_model_directory(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "model")
    model = empty_model(AutoConfig.from_pretrained(directory), torch.bfloat16, "sdpa")
    layers = list(model.model.layers)
    events: list[str] = []

    def finish(scope: torch.nn.Module) -> None:
        events.append(f"finish {layers.index(scope)}" if scope in layers else "finish model")

    fill_model(model, Recording(SafetensorsSource(directory), events), torch.bfloat16, torch.device("cpu"), finish)
    finishes = [index for index, event in enumerate(events) if event.startswith("finish")]
    assert [events[index] for index in finishes] == ["finish 0", "finish 1", "finish model"]
    assert all(".layers.0." in event for event in events[: finishes[0]])
    assert all(".layers.1." in event for event in events[finishes[0] + 1 : finishes[1]])
    assert not any(".layers." in event for event in events[finishes[1] :])
    assert all(parameter.dtype == torch.bfloat16 for parameter in model.parameters())


def test_a_layer_is_finished_with_its_grids_and_what_finishing_leaves_becomes_values(tmp_path: Path):
    from streamchat.weights.gguf_source import GgufSource

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    filled = {}
    for grids in (True, False):
        model = empty_model(config, torch.float32, "sdpa")
        source = GgufSource(path, model)
        fuse_projections(model)
        seen: list[bool] = []

        def finish(scope: torch.nn.Module, seen: list[bool] = seen) -> None:
            if hasattr(scope, "self_attn"):  # a decoder layer, not the whole model at the end
                seen.append(isinstance(scope.self_attn.qkv_proj.linear, GridLinear))

        fill_model(model, source, torch.float32, torch.device("cpu"), finish, grids=grids)
        assert seen == [grids, grids]
        fused = model.model.layers[0].self_attn.qkv_proj.linear
        assert type(fused) is torch.nn.Linear and fused.weight.shape == (32 + 16 + 16, 32)  # q, k, v rows
        filled[grids] = fused.weight
    assert torch.equal(filled[True], filled[False])  # the grid's values, as the file's blocks give them
