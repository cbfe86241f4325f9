"""``layer_windows`` against transformers' own reading of the same configs: the layers a window
applies to and its width, for Mistral, Qwen2 and Qwen3."""

import json

import pytest
import transformers

from kvfleet.compute_service.model.config import ModelConfig, ModelLoadError
from kvfleet.compute_service.model.sliding_window import WindowConfigError, droppable_window, layer_windows


def _saved(config) -> dict:
    """The config as transformers writes config.json."""
    return json.loads(config.to_json_string())


def _transformers_windows(config) -> tuple:
    """The window transformers' attention layers use, per layer (``None``: full)."""
    if config.model_type == "mistral":
        return (config.sliding_window,) * config.num_hidden_layers
    return tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4)
CASES = [
    ("mistral", dict(sliding_window=24)),
    ("mistral", dict(sliding_window=None)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=40, max_window_layers=0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=40, max_window_layers=2)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=40, max_window_layers=0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=40,
                   layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"])),
    ("qwen3", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),
    ("qwen3", dict()),
]


@pytest.mark.parametrize("model_type,fields", CASES)
def test_windows_match_transformers(model_type, fields):
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **fields)
    raw = _saved(config)
    assert layer_windows(raw, config.num_hidden_layers) == _transformers_windows(config)


def test_qwen2_without_layer_types_slides_from_max_window_layers():
    """An older config.json without ``layer_types``: layers ``>= max_window_layers`` slide."""
    raw = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 40, "max_window_layers": 3}
    assert layer_windows(raw, 4) == (None, None, None, 40)
    assert layer_windows({**raw, "use_sliding_window": False}, 4) == (None,) * 4


def test_droppable_only_when_every_layer_slides():
    assert droppable_window((24, 40)) == 40
    assert droppable_window((None, 40)) is None
    assert droppable_window((None, None)) is None


@pytest.mark.parametrize("raw", [
    {"model_type": "mistral", "sliding_window": 0},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": "40"},
    {"model_type": "qwen2", "use_sliding_window": False, "layer_types": ["sliding_attention"] * 2},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"]},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked", "full"]},
])
def test_contradictions_are_refused(raw):
    with pytest.raises(WindowConfigError):
        layer_windows(raw, 2)


def test_model_config_carries_windows_and_names_the_file():
    config = transformers.AutoConfig.for_model("mistral", **SMALL, sliding_window=24)
    assert ModelConfig.from_dict(_saved(config)).layer_windows == (24,) * 4
    with pytest.raises(ModelLoadError, match="config.json: sliding_window must be"):
        ModelConfig.from_dict({**_saved(config), "sliding_window": -1})
