"""What the router reads from the model directory to turn requests into tokens and tokens into
answers: the tokenizer, the chat template and the end-of-turn tokens. Loaded once, on first use.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvfleet.router.chat_template import ChatTemplate, end_of_turn_ids
from kvfleet.router.nodes import NodeTable
from kvfleet.router.request import ModelVocabulary


class NoTokenizer(Exception):
    """No model directory to read ``tokenizer.json`` from yet."""


@dataclass(slots=True, frozen=True)
class ModelText:
    name: str                       # the model's name for clients (its directory's name)
    tokenizer: ModelVocabulary      # the tokenizer's encoder, checked against the model's vocabulary
    chat: ChatTemplate
    end_of_turn: frozenset[int]


def load_model_text(model_dir: str) -> ModelText:
    from pathlib import Path

    from kvfleet.compute_service.model.config import ModelConfig
    from kvfleet.compute_service.model.tokenizer import Tokenizer  # tokenizers is slow to import

    tokenizer = Tokenizer(model_dir)

    def token_id(text: str) -> int | None:
        ids = tokenizer.encode(text)
        return ids[0] if len(ids) == 1 else None

    vocabulary = ModelVocabulary(tokenizer, ModelConfig.from_dir(model_dir).vocab_size)
    return ModelText(Path(model_dir).name, vocabulary, ChatTemplate.from_model_dir(model_dir),
                     end_of_turn_ids(model_dir, token_id))


class TokenizerSource:
    """The model's text side, from ``--model`` or else the model directory a READY node advertises
    (the router runs next to the nodes, or mounts the same model volume)."""

    def __init__(self, nodes: NodeTable, model_dir: str | None = None):
        self.nodes = nodes
        self.model_dir = model_dir
        self._model: ModelText | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> ModelText:
        if self._model is not None:
            return self._model
        async with self._lock:
            if self._model is None:
                model_dir = self.model_dir or next((n.info.model for n in self.nodes.ready()), None)
                if model_dir is None:
                    raise NoTokenizer("no READY compute node yet (its model directory gives the tokenizer)")
                self._model = await asyncio.to_thread(load_model_text, model_dir)
        return self._model
