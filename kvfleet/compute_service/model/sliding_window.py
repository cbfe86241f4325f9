"""Which layers of a model attend through a sliding window, and how wide, read from ``config.json``
exactly as transformers 5 reads it. Pure Python.

The window's meaning (transformers' ``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx -
sliding_window``): a query at position ``p`` sees the keys ``p - window + 1 .. p``, i.e. ``window``
keys, itself included. ``None`` means full causal attention.

Each architecture names its rule in ``architectures.ARCHITECTURES`` (``windows``):

- **every_layer** (Mistral, Phi-3): ``sliding_window`` (null: none) on every layer; transformers
  ignores ``layer_types`` for these (Mistral only warns), so does this.
- **qwen** (Qwen2, Qwen3): ``sliding_window`` counts only when ``use_sliding_window`` is true.
  Which layers: the ``layer_types`` list when the config has one (transformers 5 writes it:
  ``"sliding_attention"`` / ``"full_attention"`` per layer), else layers ``i >= max_window_layers``
  slide and the first ``max_window_layers`` attend in full.
- **layer_types** (Gemma 2): ``layer_types`` when given, else even layers slide and odd ones attend
  in full (0: sliding, 1: full, ...).
- **none** (Llama): full attention whatever the config says.

A field config.json omits takes its architecture's default (``Architecture.defaults``).
"""

from __future__ import annotations

from kvfleet.compute_service.model.architectures import architecture

SLIDING, FULL = "sliding_attention", "full_attention"

# the config.json fields each rule reads
RULE_FIELDS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "every_layer": frozenset({"sliding_window"}),
    "qwen": frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
    "layer_types": frozenset({"sliding_window", "layer_types"}),
}
# fields that switch a rule's windows off while keeping the rest of the config (tests compare both)
RULE_OFF: dict[str, dict] = {"every_layer": {"sliding_window": None}, "qwen": {"use_sliding_window": False}}


class WindowConfigError(ValueError):
    """A config whose sliding-window fields contradict each other or are malformed."""


def layer_windows(raw_config: dict, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer attention window in tokens (``None``: full attention), ``num_layers`` long."""
    arch = architecture(raw_config.get("model_type"))
    raw_config, rule = {**arch.defaults, **raw_config}, arch.windows
    if rule == "every_layer":
        return (_window(raw_config.get("sliding_window")),) * num_layers
    if rule == "layer_types":
        window = _window(raw_config.get("sliding_window"))
        default = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
        return _typed(raw_config.get("layer_types") or default, window, num_layers)
    if rule != "qwen":
        return (None,) * num_layers
    use = raw_config.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise WindowConfigError(f"use_sliding_window must be true or false, got {use!r}")
    window = _window(raw_config.get("sliding_window")) if use else None
    layer_types = raw_config.get("layer_types")
    if layer_types is None:
        first = raw_config.get("max_window_layers")
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise WindowConfigError(f"max_window_layers must be a non-negative integer, got {first!r}")
        return tuple(window if window is not None and i >= first else None for i in range(num_layers))
    return _typed(layer_types, window, num_layers)


def _typed(layer_types, window: int | None, num_layers: int) -> tuple[int | None, ...]:
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise WindowConfigError(f"layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
    windows: list[int | None] = []
    for i, kind in enumerate(layer_types):
        if kind not in (SLIDING, FULL):
            raise WindowConfigError(f"layer_types[{i}] is {kind!r}; supported: {SLIDING!r}, {FULL!r}")
        if kind == SLIDING and window is None:
            raise WindowConfigError(
                f"layer_types[{i}] is {SLIDING!r} but the model has no window "
                "(use_sliding_window is false or sliding_window is null)")
        windows.append(window if kind == SLIDING else None)
    return tuple(windows)


def droppable_window(windows: tuple[int | None, ...]) -> int | None:
    """The window beyond which no layer reads a key (the widest), or ``None`` when some layer
    attends in full: only then may a sequence's oldest blocks be given back."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def _window(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise WindowConfigError(f"sliding_window must be a positive integer or null, got {value!r}")
    return value
