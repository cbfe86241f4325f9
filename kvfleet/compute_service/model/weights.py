"""Load ``*.safetensors`` weights in Hugging Face naming into ``CausalLM`` as ``checkpoint_layout``
maps them (q/k/v and gate/up fused). Every problem is a ``ModelLoadError`` naming the file and the
tensor."""

from __future__ import annotations

from pathlib import Path

import torch

from kvfleet.compute_service.model.causal_lm import CausalLM, rotary_embedding
from kvfleet.compute_service.model.checkpoint_layout import Part, model_layout
from kvfleet.compute_service.model.config import ModelConfig, ModelLoadError

MAX_NAMED = 6  # tensors named in a refusal; the rest are counted
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} holds no *.safetensors weights file")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
    return tensors


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


class _Checkpoint:
    """The checkpoint's tensors, taken one by one: a missing or misshapen tensor is noted, and
    whatever is never taken is left over (both refuse the model in ``done``)."""

    def __init__(self, model_dir: Path, tensors: dict[str, torch.Tensor]):
        self.model_dir, self.left = model_dir, dict(tensors)
        self.missing: list[str] = []

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.left.pop(name, None)
        if t is None:
            self.missing.append(name)
            return torch.zeros(shape)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{self.model_dir}: weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    def take_copy(self, name: str, same_as: torch.Tensor) -> None:
        """Use up ``name`` if the checkpoint holds it as an exact copy of ``same_as``."""
        t = self.left.get(name)
        if t is not None and t.shape == same_as.shape and torch.equal(t, same_as):
            del self.left[name]

    def cat(self, parts: list[Part]) -> torch.Tensor:
        """The named tensors joined along their first dimension (one part: a copy of it)."""
        tensors = [self.take(name, shape) for name, shape in parts]
        # a copy either way: a view would keep the whole memory-mapped file resident (the model twice)
        return tensors[0].clone() if len(tensors) == 1 else torch.cat(tensors)

    def done(self) -> None:
        if self.missing:
            raise ModelLoadError(f"{self.model_dir}: the checkpoint lacks {len(self.missing)} tensor(s) the "
                                 f"config needs: {_names(self.missing)}")
        if self.left:
            raise ModelLoadError(f"{self.model_dir}: the checkpoint has {len(self.left)} tensor(s) this config does "
                                 f"not use (an unsupported feature?): {_names(list(self.left))}")


def load_model(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
               device: torch.device) -> CausalLM:
    """The model with every parameter filled from the checkpoint and every checkpoint tensor used."""
    model_dir = Path(model_dir)
    ckpt = _Checkpoint(model_dir, read_safetensors(model_dir))
    c = config
    state = {name: ckpt.cat(parts).to(device) for name, parts in model_layout(c).items()}
    if c.tie_word_embeddings:  # some tied checkpoints store the head anyway: a copy of the embedding is used up
        ckpt.take_copy("lm_head.weight", state["embed_tokens.weight"])
    ckpt.done()

    with torch.device("meta"):  # no storage: the checkpoint's tensors become the parameters (assign)
        model = CausalLM(c)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    if c.tie_word_embeddings:  # assigned, the embedding is a new tensor: the head shares it again
        model.lm_head.weight = model.embed_tokens.weight
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:  # the mapping above and CausalLM disagree: a bug here, not the model's
        raise ModelLoadError(f"{model_dir}: parameters left unfilled {missing}, unexpected {unexpected}")
    model = model.to(dtype=dtype)
    # RoPE tables stay float32 whatever the weights' dtype (they are cast per use)
    with torch.device(device):
        model.rope = rotary_embedding(c)
    return model.eval()
