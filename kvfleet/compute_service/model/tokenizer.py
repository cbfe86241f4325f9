"""The model's ``tokenizer.json`` and incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path

from kvfleet.compute_service.model.config import ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception type for malformed files
            raise ModelLoadError(f"{path} is not a valid tokenizer file: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Text of each new token as it arrives; bytes of an unfinished UTF-8 character are held back
    until the character completes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._take(final=False)

    def flush(self) -> str:
        """The text held back, at the end of the output: an unfinished character ends as
        ``decode`` ends it (U+FFFD), so the pieces add up to the decode of every token."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        """The text the ids since ``read_offset`` add, once it does not end inside a character
        (or ``final``: whatever it is)."""
        before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before):]
        return ""
