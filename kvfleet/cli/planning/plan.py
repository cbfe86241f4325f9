"""A capacity plan: the memory arithmetic at the asked block size, the same at each scenario
preset's block size, and (given a target) the hardware sizing. Pure; rendered by ``render``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvfleet.cli.planning.capacity import SCENARIOS, Capacity, CapacityRequest, capacity
from kvfleet.cli.planning.devices import Device
from kvfleet.cli.planning.shapes import ModelShape
from kvfleet.cli.planning.sizing import Sizing, SizingRequest, size_hardware


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    block_size: int
    reason: str
    capacity: Capacity


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelShape
    device: Device
    request: CapacityRequest
    capacity: Capacity
    scenarios: tuple[Scenario, ...]
    sizing: Sizing | None
    warnings: tuple[str, ...] = field(default=())


class ContextTooLong(ValueError):
    """The context exceeds the model's positions (``--force`` plans anyway)."""


def make_plan(model: ModelShape, device: Device, request: CapacityRequest, sizing: SizingRequest | None = None,
              force: bool = False) -> Plan:
    warnings = []
    longest = max(request.context, sizing.avg_context if sizing else 0)
    if longest > model.max_position_embeddings:
        message = (f"context {longest:,} is longer than {model.name}'s {model.max_position_embeddings:,} positions")
        if not force:
            raise ContextTooLong(f"{message} (--force plans anyway)")
        warnings.append(message)
    if request.block_size % 64:
        warnings.append(f"block size {request.block_size} is not a multiple of 64, as the guide asks "
                        "(the engine takes any multiple of 16)")
    cap = capacity(model, device, request)
    if cap.kv_budget_bytes <= 0:
        warnings.append(f"the weights ({cap.weights_bytes_per_device:,} B per device) and the activation reserve "
                        "leave no KV memory: raise --tensor-parallel or pick a larger device")
    scenarios = tuple(Scenario(name, bs, reason, capacity(model, device, request, bs)) for name, bs, reason in SCENARIOS)
    result = None
    if sizing is not None:
        at_avg = capacity(model, device, replace(request, context=sizing.avg_context))
        result = size_hardware(model, device, request.tensor_parallel, cap.kv_bytes_per_token,
                               at_avg.max_concurrent_seqs, sizing)
    return Plan(model, device, request, cap, scenarios, result, tuple(warnings))
