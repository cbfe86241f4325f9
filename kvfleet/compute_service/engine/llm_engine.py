"""``LLMEngine``: a model directory served in-process with continuous batching over a paged pool.

    add_request() -> Scheduler (policy) -> ModelRunner (tensors, model) -> Sampler -> outputs
                         |
                    KVCacheManager -> BlockAllocator (in-process core, or block_service remotely)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvfleet.compute_service.engine.config import EngineConfig
from kvfleet.compute_service.engine.cpu_host import usable_cpus
from kvfleet.compute_service.engine.cpu_malloc import keep_heap
from kvfleet.compute_service.engine.model_runner import ModelRunner
from kvfleet.compute_service.engine.prefill_rate import PrefillRate
from kvfleet.compute_service.engine.request_output import RequestOutput, StopChecker
from kvfleet.compute_service.engine.request_phases import RequestPhases
from kvfleet.compute_service.engine.sampler import Sampler
from kvfleet.compute_service.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.engine.stats import EngineStats
from kvfleet.compute_service.engine.thread_governor import ThreadGovernor, thread_candidates
from kvfleet.compute_service.engine.thread_probe import ThreadProbe
from kvfleet.compute_service.kv.cache_dtype import ELEMENT_BYTES, kv_bytes_per_token, resolve_kv_cache_dtype
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.compute_service.kv.layout import reserved_tokens
from kvfleet.compute_service.kv.pool import (
    allocate_kv_cache,
    bytes_per_block,
    kv_cache_dtype,
    num_blocks_for,
)
from kvfleet.compute_service.kv.tier_setup import build_tiers, measure_prefill
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.compute_service.model.cpu_linear import pack_linears, step_rows
from kvfleet.compute_service.model.sliding_window import droppable_window
from kvfleet.compute_service.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvfleet.compute_service.model.weights import load_model, parse_dtype
from kvfleet.core.allocator import BlockAllocator, Refusal
from kvfleet.core.sampling import SamplingParams

log = logging.getLogger(__name__)

SUMMARY_CHARS = 300  # of an exception's message, in what a failed request's client reads


def summary(exc: BaseException) -> str:
    """``exc`` in one line a client can read: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 3] + "..."


def kv_memory_per_token(mc: ModelConfig, chosen: str) -> str:
    """``'1088 B/token (float32 4096, bfloat16 2048, float16 2048, fp8_e4m3 1088)'``: what a token
    costs in the pool here, beside every dtype it could have been."""
    cost = {name: kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, name) for name in ELEMENT_BYTES}
    return f"{cost[chosen]} B/token (" + ", ".join(f"{name} {n}" for name, n in cost.items()) + ")"


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    on_output: Callable[[RequestOutput], None] | None = None
    text: list[str] = field(default_factory=list)
    timed: bool = False  # its first token's phases are recorded


AllocatorFactory = Callable[[int, int, int], BlockAllocator]  # (num_blocks, block_size, bytes_per_block)


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 allocator_factory: AllocatorFactory | None = None):
        self.config = config = config or EngineConfig()
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.device = torch.device(config.device)
        # thread_governor.py: why the count is re-decided while the engine works
        threads = thread_candidates(usable_cpus(), os.environ) if self.device.type == "cpu" else ()
        if self.device.type == "cpu":
            keep_heap(os.environ)  # cpu_malloc.py: a step's tensors in pages already faulted in
        if threads:
            torch.set_num_threads(threads[0])
        dtype = parse_dtype(config.dtype)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, config.dtype, self.device)  # FP8 here? checked first
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_context_len, mc.max_context_len)
        model = load_model(model_dir, mc, dtype, self.device)
        packed = pack_linears(model, config.max_num_batched_tokens, threads)
        self.thread_probe = ThreadProbe(model, dtype, ThreadGovernor(threads)) if threads else None
        block_size = int(config.block_size)
        self.bytes_per_block = bytes_per_block(mc, block_size, kv_dtype)
        num_blocks = num_blocks_for(mc, block_size, kv_dtype, self.device, config.kv_cache_memory)
        reserve = reserved_tokens(config.kv_layout, self.max_model_len)
        if reserve is not None and -(-reserve // block_size) > num_blocks:
            raise ValueError(f"--kv-layout contiguous reserves max_model_len {reserve} tokens "
                             f"({-(-reserve // block_size)} blocks of {block_size}) per sequence, but the pool holds "
                             f"{num_blocks} blocks: lower --max-model-len or raise --kv-cache-memory")
        if allocator_factory is None:
            from kvfleet.block_service.local_allocator import LocalBlockAllocator

            def allocator_factory(n: int, bs: int, bpb: int) -> BlockAllocator:
                return LocalBlockAllocator.standalone(n, bs, bpb, node_id=config.node_id)
        self.allocator = allocator_factory(num_blocks, block_size, self.bytes_per_block)
        kv_cache, kv_scales = allocate_kv_cache(mc, num_blocks, block_size, kv_dtype, self.device)
        self.runner = ModelRunner(model, kv_cache, block_size, self.device, kv_scales)
        self.tiers = None if reserve is not None else build_tiers(
            kv_cache, kv_scales, block_size, self.bytes_per_block, self.allocator.record_tiers,
            config.kv_host_memory, config.kv_disk_dir, config.kv_disk_bytes, config.preemption_mode,
            lambda: self._prefill_rate(model, block_size, kv_dtype))
        if self.tiers is not None:
            self.allocator.set_tier_source(self.tiers.entries)
        self.kv = KVCacheManager(self.allocator, config.share_prefix_across_tenants,
                                 droppable_window(mc.layer_windows), reserve, self.tiers)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.long_prefill_token_threshold,
                                                   step_rows(config.max_num_batched_tokens) if packed else None),
                                   self.kv)
        self.sampler = Sampler(self.device)
        self.requests: dict[str, _Request] = {}
        self._generated = self._prompt_computed = 0
        self._busy = 0.0
        self.num_step_failures = 0
        self.prefill_rate = PrefillRate()  # measured on its own steps (the warm-up's first)
        self.phases = RequestPhases()
        self.stalled = False  # the last step scheduled nothing: every sequence waits for blocks
        log.info("engine ready: %s, %d blocks of %d tokens (%d bytes each), max_model_len %d, %s layout, KV cache %s: %s",
                 mc.model_type, num_blocks, block_size, self.bytes_per_block, self.max_model_len, config.kv_layout,
                 self.kv_cache_dtype, kv_memory_per_token(mc, self.kv_cache_dtype))
        counts = self.tiers.counts() if self.tiers is not None else None
        log.info("KV tiers: hot %d blocks, host %d blocks, disk %d blocks; preemption %s", num_blocks,
                 counts.host_blocks if counts else 0, counts.disk_blocks if counts else 0,
                 config.preemption_mode if counts else "recompute")

    def _prefill_rate(self, model, block_size: int, kv_dtype: torch.dtype) -> float:
        """Prefill tokens/s of a short chunk through a scratch pool (the swap cost model's)."""
        def scratch(num_blocks: int) -> ModelRunner:
            cache, scales = allocate_kv_cache(self.model_config, num_blocks, block_size, kv_dtype, self.device)
            return ModelRunner(model, cache, block_size, self.device, scales)

        tokens = min(self.config.max_num_batched_tokens, 2 * block_size, self.max_model_len - 1)
        return measure_prefill(scratch, tokens, block_size)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], sampling: SamplingParams,
                    tenant: str = "default", priority: int = 0,
                    on_output: Callable[[RequestOutput], None] | None = None,
                    generated: list[int] | tuple[int, ...] = (), arrival_s: float | None = None,
                    prefix_group: str = "") -> None:
        """Queue a request; bad input raises ``ValueError`` naming the problem (nothing is queued).

        ``generated`` is output another node already produced and delivered (a request resumed
        after that node failed): it counts against ``max_tokens`` and goes through the
        detokenizer and the stop checker as if generated here, without being emitted again, so the
        text that follows is what the client would have read had nothing failed. ``arrival_s``
        (``time.monotonic``): when the request reached the node, if before this call. ``prefix_group``:
        the tenant's group, whose salt its chain takes (the router's decision)."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError("sampling must be SamplingParams")
        if not request_id or request_id in self.requests:
            raise ValueError(f"request_id must be non-empty and unique, got {request_id!r}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        generated = list(generated)
        self.check_prompt(ids, generated)
        seq = Sequence(request_id, ids, sampling, tenant=tenant, priority=priority, prefix_group=prefix_group)
        if arrival_s is not None:
            seq.arrival_s = arrival_s
        eos = () if sampling.ignore_eos else self.model_config.eos_token_ids
        request = _Request(seq, IncrementalDetokenizer(self.tokenizer), StopChecker(sampling, eos, self.max_model_len),
                           on_output)
        self._replay(request, generated)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def check_prompt(self, ids: list[int], generated: list[int] | tuple[int, ...] = ()) -> None:
        """``ValueError`` naming why a prompt (plus output already delivered) cannot run here: an id
        outside the vocabulary, too long for max_model_len or for the pool. Reads only what is fixed
        at start, so a node may call it on its event loop before asking block_service for blocks."""
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in [*ids, *generated] if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        num_tokens = len(ids) + len(generated)
        if num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {num_tokens} tokens; max_model_len is {self.max_model_len} "
                             "(the prompt must leave room for at least one generated token)")
        need = self.kv.blocks_to_admit(num_tokens + 1)
        if need > self.allocator.num_blocks:
            raise ValueError(f"prompt needs {need} KV blocks ({self.config.kv_layout} layout) but this node's pool has only "
                             f"{self.allocator.num_blocks}")

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, "abort", [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; the outputs of every request that progressed.

        A step that raises ends the requests it concerns with the error (``_fail_step``), not the
        engine: the next step runs the others."""
        if self.thread_probe is not None:
            self.thread_probe.maybe_probe()
        self.allocator.begin_step()
        try:
            return self._step()
        except Exception as exc:
            return self._fail_step(exc)
        finally:
            self.allocator.end_step()

    def fail_request(self, request_id: str, reason: str) -> None:
        """End a request with a failure another node may recover from (a no-op once it finished)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, "abort", [], failure=reason)

    def _fail_step(self, exc: Exception) -> list[RequestOutput]:
        """A step raised part-way: the sequences it touched (every one not waiting: running, or
        taken from the queue when it failed) may hold half-updated state, so they are finished
        with finish reason ``error`` and the exception's one-line summary as their failure (their
        blocks released); the node answers them INTERNAL and the router may try another node. The
        waiting ones never ran this step and stay. One ERROR line with the traceback in the log."""
        waiting = {seq.seq_id for seq in self.scheduler.waiting}
        failed = [r for r in self.requests.values() if r.seq.seq_id not in waiting]
        log.exception("engine step failed; ending its %d requests with the error", len(failed))
        self.stalled = False
        self.num_step_failures += 1
        reason = f"engine step failed on node {self.config.node_id}: {summary(exc)}"
        return [self._finish(r, "error", [], failure=reason) for r in failed]

    def _step(self) -> list[RequestOutput]:
        if self.tiers is not None:
            self.tiers.apply_refusals(self.allocator.take_tier_refusals())
        batch = self.scheduler.schedule()
        self.stalled = batch.is_empty and not batch.refused  # every sequence waits for blocks
        outputs = [self._finish(self.requests[seq.seq_id], "abort", [], refusal)
                   for seq, refusal in batch.refused]
        if batch.is_empty:
            return outputs
        started = time.perf_counter()
        self.phases.scheduled([s for s, _ in batch.prefills] + batch.decodes, time.monotonic())
        if self.tiers is not None:
            self.tiers.before_forward()  # the step's demotions, promotions and swaps have landed
        logits, sampled = self.runner.execute(batch)
        for seq, n in batch.prefills:
            seq.num_computed += n
            self._prompt_computed += n
        for seq in batch.decodes:
            seq.num_computed += 1
        stepped = [s for s, _ in batch.prefills] + batch.decodes
        self.kv.commit_full_blocks(stepped)
        self.kv.drop_outside_window(stepped)
        tokens = self.sampler.sample(logits, sampled)
        elapsed = time.perf_counter() - started
        self._busy += elapsed
        self.prefill_rate.observe(sum(n for _, n in batch.prefills), len(batch.decodes), elapsed)
        now = time.monotonic()
        for seq, token in zip(sampled, tokens):
            request = self.requests[seq.seq_id]
            if not request.timed:
                request.timed = True
                self.phases.first_token(seq, now)
            outputs.append(self._append_token(request, token))
        # a prefill chunk that samples nothing yet is progress too: an output without tokens tells a
        # streaming caller the request is alive (a 128K prompt prefills for minutes before its first token)
        sampled_ids = {seq.seq_id for seq in sampled}
        outputs += [self._output(self.requests[seq.seq_id], [], "", None)
                    for seq, _ in batch.prefills if seq.seq_id not in sampled_ids]
        return outputs

    def generate(self, prompts: list[str | list[int]], sampling: SamplingParams) -> list[RequestOutput]:
        """Run ``prompts`` to completion together; one merged output per prompt, in order."""
        base = f"gen-{time.monotonic_ns()}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, sampling)
        merged = {rid: RequestOutput.empty(rid) for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                merged[out.request_id] = merged[out.request_id].merged(out)
        return [merged[rid] for rid in ids]

    def stats(self) -> EngineStats:
        queue_time, prefill_time = self.phases.snapshots()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            max_num_seqs_live=self.scheduler.num_seqs_cap,
            generated_tokens=self._generated, prompt_tokens_computed=self._prompt_computed,
            num_preemptions=self.scheduler.num_preemptions, num_step_failures=self.num_step_failures,
            busy_seconds=self._busy,
            blocks=self.allocator.stats(), lookups=replace(self.kv.lookups),
            tiers=self.tiers.counts() if self.tiers is not None else None, num_swapped=self.scheduler.num_swapped,
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s or 0.0,
            intra_op_threads=torch.get_num_threads() if self.device.type == "cpu" else 0,
            queue_time=queue_time, prefill_time=prefill_time)

    # -- internals --------------------------------------------------------------------------------

    @staticmethod
    def _replay(request: _Request, generated: list[int]) -> None:
        """Bring a resumed request's sequence, detokenizer and stop checker to where the node that
        generated ``generated`` left them. The text held back there (the bytes of an unfinished
        character, what may be the start of a stop string) was never delivered and is emitted from
        here; a stop string that straddles the failure is found."""
        seq = request.seq
        for token in generated:
            seq.token_ids.append(token)
            reason, _ = request.stop.check(seq, token, request.detokenizer.push(token))
            if reason is not None:
                raise ValueError(f"the {len(generated)} resumed tokens already finish the request ({reason})")

    def _append_token(self, request: _Request, token: int) -> RequestOutput:
        seq = request.seq
        seq.token_ids.append(token)
        self._generated += 1
        text = request.detokenizer.push(token)
        if request.stop.last_token(seq, token) is not None:
            text += request.detokenizer.flush()
        reason, text = request.stop.check(seq, token, text)
        request.text.append(text)
        if reason is not None:
            return self._finish(request, reason, [token], text=text)
        return self._output(request, [token], text, None)

    def _finish(self, request: _Request, reason: str, new_tokens: list[int], refusal: Refusal | None = None,
                text: str = "", failure: str | None = None) -> RequestOutput:
        seq = request.seq
        self.scheduler.finish([seq])
        self.sampler.forget(seq.seq_id)
        del self.requests[seq.seq_id]
        return self._output(request, new_tokens, text, reason, refusal, failure)

    def _output(self, request: _Request, tokens: list[int], text: str, reason: str | None,
                refusal: Refusal | None = None, failure: str | None = None) -> RequestOutput:
        seq = request.seq
        out = RequestOutput(
            request_id=seq.seq_id, new_token_ids=tokens, new_text=text, finished=reason is not None,
            finish_reason=reason, prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens, cached_tokens=seq.num_cached_tokens, refusal=refusal,
            failure=failure)
        if request.on_output is not None:
            request.on_output(out)
        return out
