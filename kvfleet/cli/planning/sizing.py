"""Hardware sizing by roofline: how many devices reach a target of generated tokens/s. Pure.

A decode step of a replica (``tensor_parallel`` devices) serving ``B`` sequences at ``context``
tokens reads, on each device, its share of the weights once (shared by the whole batch) and every
sequence's KV; it is bound by memory bandwidth unless its FLOPs take longer:

    t_step(B) = max( (weights_read(B) / TP + B x context x kv_bytes/token) / bandwidth,
                     B x flops/token(context) / (TP x FLOP/s) )
    decode tokens/s = B / t_step(B)

Prefill is bound by compute: each request's ``context`` prompt tokens cost flops/token at half the
context on average, and the time a replica spends on them is taken from decoding. Replicas are added
until the concurrency, split across them, fits each one's KV pool and the target is met.
Communication between tensor-parallel ranks is not modelled: a roofline is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.cli.planning.devices import Device, guide_verdict
from kvfleet.cli.planning.shapes import ModelShape

MAX_REPLICAS = 4096


@dataclass(frozen=True, slots=True)
class SizingRequest:
    target_tokens_per_s: float
    avg_context: int
    concurrency: int
    avg_output: int = 256        # generated tokens per request: sets how many prompts are prefilled

    def __post_init__(self) -> None:
        if self.target_tokens_per_s <= 0:
            raise ValueError(f"--target-tokens-per-s must be positive, got {self.target_tokens_per_s}")
        if self.avg_context < 1 or self.concurrency < 1 or self.avg_output < 1:
            raise ValueError("--avg-context, --concurrency and --avg-output must be at least 1")


@dataclass(frozen=True, slots=True)
class Sizing:
    decode_step_s: float                  # one replica at its share of the concurrency
    decode_tokens_per_s_per_replica: float
    decode_bound: str                     # "memory bandwidth" or "compute"
    prefill_tokens_per_s_per_replica: float
    replicas: int | None                  # None: the target is out of reach at this concurrency
    devices_needed: int | None
    seqs_per_replica: int
    achieved_tokens_per_s: float
    guide: str
    note: str


def decode_step(shape: ModelShape, device: Device, tp: int, kv_bytes_per_token: int, batch: int,
                context: int) -> tuple[float, str]:
    """Seconds for one decode step of ``batch`` sequences at ``context`` tokens, and its bound."""
    memory = (shape.decode_weight_bytes(batch) / tp + batch * context * kv_bytes_per_token) / device.bandwidth
    compute = batch * shape.flops_per_token(context) / (tp * device.flops)
    return (memory, "memory bandwidth") if memory >= compute else (compute, "compute")


def decode_tokens_per_s(shape: ModelShape, device: Device, tp: int, kv_bytes_per_token: int, batch: int,
                        context: int) -> float:
    return batch / decode_step(shape, device, tp, kv_bytes_per_token, batch, context)[0]


def size_hardware(shape: ModelShape, device: Device, tp: int, kv_bytes_per_token: int, max_seqs_per_replica: int,
                  request: SizingRequest) -> Sizing:
    """The fewest replicas that meet the target (``max_seqs_per_replica``: the plan's KV capacity
    at ``avg_context``)."""
    prefill_tps = tp * device.flops / shape.flops_per_token(request.avg_context // 2)
    prefill_load = request.target_tokens_per_s / request.avg_output * request.avg_context  # prompt tokens/s
    guide = guide_verdict(request.target_tokens_per_s)
    best = (0.0, 0, 1)
    for replicas in range(1, min(request.concurrency, MAX_REPLICAS) + 1):
        batch = -(-request.concurrency // replicas)
        if batch > max_seqs_per_replica:
            continue
        prefill_busy = prefill_load / replicas / prefill_tps
        if prefill_busy >= 1:
            continue
        step, _ = decode_step(shape, device, tp, kv_bytes_per_token, batch, request.avg_context)
        achieved = request.concurrency / step * (1 - prefill_busy)
        if achieved > best[0]:
            best = (achieved, replicas, batch)
        if achieved >= request.target_tokens_per_s:
            return _sizing(shape, device, tp, kv_bytes_per_token, request, prefill_tps, replicas, batch,
                           achieved, guide, "")
    achieved, replicas, batch = best
    if max_seqs_per_replica == 0:
        note = (f"not one sequence of {request.avg_context} tokens fits a replica's KV memory: raise "
                "--tensor-parallel or pick a larger device")
    elif not replicas:
        note = (f"prefill alone ({prefill_load:,.0f} prompt tokens/s) outruns {request.concurrency} replicas, "
                "one per sequence in flight: raise --concurrency")
    else:
        note = (f"out of reach at concurrency {request.concurrency}: at best {achieved:,.0f} tokens/s "
                f"({replicas} replicas of {batch} sequences); raise --concurrency (a step serves "
                "each sequence one token, whatever the hardware)")
    return _sizing(shape, device, tp, kv_bytes_per_token, request, prefill_tps, None, max(batch, 1), achieved,
                   guide, note)


def _sizing(shape: ModelShape, device: Device, tp: int, kv_bytes_per_token: int, request: SizingRequest,
            prefill_tps: float, replicas: int | None, batch: int, achieved: float, guide: str, note: str) -> Sizing:
    step, bound = decode_step(shape, device, tp, kv_bytes_per_token, batch, request.avg_context)
    return Sizing(decode_step_s=step, decode_tokens_per_s_per_replica=batch / step, decode_bound=bound,
                  prefill_tokens_per_s_per_replica=prefill_tps, replicas=replicas,
                  devices_needed=None if replicas is None else replicas * tp, seqs_per_replica=batch,
                  achieved_tokens_per_s=achieved, guide=guide, note=note)
