"""Which checkpoint tensors (Hugging Face names and shapes) fill which engine parameter, derived from a
``ModelConfig`` and its architecture's entry. Pure: no torch.

The engine fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``; a checkpoint that
stores them apart (Llama, Qwen, Gemma) is concatenated along the output rows in that order, one that
stores them fused (Phi-3) is taken as it is. The loader (``weights``) takes exactly these tensors and
refuses a checkpoint with any other; the model maker writes exactly these.
"""

from __future__ import annotations

from kvfleet.compute_service.model.config import ModelConfig

Part = tuple[str, tuple[int, ...]]  # (checkpoint name, shape)


def _linear(src: str, names: list[str], fused: str, rows: list[int], cols: int, bias: bool,
            fuse_in_checkpoint: bool) -> dict[str, list[Part]]:
    """The weight (and bias) of one engine linear whose output rows are ``names``' rows in order."""
    parts = [(fused, sum(rows))] if fuse_in_checkpoint else list(zip(names, rows))
    out = {"weight": [(f"{src}{n}.weight", (r, cols)) for n, r in parts]}
    if bias:
        out["bias"] = [(f"{src}{n}.bias", (r,)) for n, r in parts]
    return out


def layer_layout(c: ModelConfig, i: int) -> dict[str, list[Part]]:
    """Layer ``i``: engine parameter name → the checkpoint tensors it is the concatenation of."""
    a = c.architecture
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    q, kv, h, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    attn, mlp = src + "self_attn.", src + "mlp."
    linears = {
        "self_attn.qkv_proj": _linear(attn, ["q_proj", "k_proj", "v_proj"], "qkv_proj", [q, kv, kv], h,
                                      c.qkv_bias, a.fused_qkv),
        "self_attn.o_proj": _linear(attn, ["o_proj"], "o_proj", [h], q, c.o_proj_bias, False),
        "mlp.gate_up_proj": _linear(mlp, ["gate_proj", "up_proj"], "gate_up_proj", [inter, inter], h,
                                    c.mlp_bias, a.fused_gate_up),
        "mlp.down_proj": _linear(mlp, ["down_proj"], "down_proj", [h], inter, c.mlp_bias, False),
    }
    # attention's weights then its biases, the MLP's likewise, the norms last (the model maker draws
    # random tensors in this order, so a seed keeps giving the same model)
    layout = {f"{dst}{name}.{kind}": tensors[kind] for group in (("self_attn.qkv_proj", "self_attn.o_proj"),
                                                                  ("mlp.gate_up_proj", "mlp.down_proj"))
              for kind in ("weight", "bias") for name in group if kind in (tensors := linears[name])}
    for norm in a.norms.names():
        layout[f"{dst}{norm}.weight"] = [(f"{src}{norm}.weight", (h,))]
    if a.qk_norm:
        for norm in ("q_norm", "k_norm"):
            layout[f"{dst}self_attn.{norm}.weight"] = [(f"{attn}{norm}.weight", (c.head_dim,))]
    return layout


def model_layout(c: ModelConfig) -> dict[str, list[Part]]:
    """Every engine parameter and its checkpoint tensors; a tied head has none of its own."""
    layout = {"embed_tokens.weight": [("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))]}
    for i in range(c.num_layers):
        layout.update(layer_layout(c, i))
    layout["norm.weight"] = [("model.norm.weight", (c.hidden_size,))]
    if not c.tie_word_embeddings:
        layout["lm_head.weight"] = [("lm_head.weight", (c.vocab_size, c.hidden_size))]
    return layout


def is_norm(checkpoint_name: str) -> bool:
    """A norm's weight (the model maker draws those around their neutral value)."""
    return checkpoint_name.endswith("norm.weight")
