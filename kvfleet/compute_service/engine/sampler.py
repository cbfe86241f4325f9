"""Turns logits into next tokens: greedy rows in one argmax, the others with temperature, top-k and
top-p and a per-request generator (seeded requests are reproducible, across preemption too)."""

from __future__ import annotations

import torch

from kvfleet.compute_service.engine.sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # logits: [len(seqs), vocab] float32
        assert logits.shape[0] == len(seqs)
        tokens = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.sampling.greedy:
                tokens[row] = self._sample_row(logits[row], seq)
        return tokens

    def forget(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)

    def _sample_row(self, logits: torch.Tensor, seq: Sequence) -> int:
        p = seq.sampling
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq)).item())

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            if seq.sampling.seed is not None:
                gen.manual_seed(seq.sampling.seed % (2**63))
            else:
                gen.seed()
            self._generators[seq.seq_id] = gen
        return gen
