"""A plan for scripts (one JSON object) and for people (aligned plain-text tables). Pure."""

from __future__ import annotations

from dataclasses import asdict

from kvfleet.cli.planning.plan import Plan

GIB = 1 << 30


def plan_dict(plan: Plan) -> dict:
    """Every figure of the plan; the names scripts rely on are at the top level."""
    cap = plan.capacity
    out = {
        "model": plan.model.name,
        "device": plan.device.name,
        "tensor_parallel": plan.request.tensor_parallel,
        "context": plan.request.context,
        "block_size": plan.request.block_size,
        "kv_cache_dtype": cap.kv_dtype,
        "num_params": plan.model.num_params(),
        "num_active_params": plan.model.num_params(active_only=True),
        **asdict(cap),
        "scenarios": [{"name": s.name, "block_size": s.block_size, "reason": s.reason,
                       "blocks_per_seq": s.capacity.blocks_per_seq,
                       "last_block_waste_tokens": s.capacity.last_block_waste_tokens,
                       "max_concurrent_seqs": s.capacity.max_concurrent_seqs} for s in plan.scenarios],
        "warnings": list(plan.warnings),
    }
    if plan.sizing is not None:
        out["sizing"] = asdict(plan.sizing)
        out["devices_needed"] = plan.sizing.devices_needed
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def table(rows: list[tuple[str, ...]], header: tuple[str, ...] | None = None) -> str:
    rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    if header:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_text(plan: Plan) -> str:
    cap, req, model = plan.capacity, plan.request, plan.model
    tp = f" x {req.tensor_parallel} (tensor parallel)" if req.tensor_parallel > 1 else ""
    budget = ("--kv-cache-memory" if req.kv_cache_memory is not None else
              f"{req.gpu_memory_utilization:g} x {_gib(plan.device.memory_bytes)} - weights - reserve")
    waste = cap.last_block_waste_tokens
    rows = [
        ("model", f"{model.name}: {model.num_params() / 1e9:,.2f}B parameters"
                  + (f" ({model.num_params(active_only=True) / 1e9:,.1f}B active)" if model.moe else "")),
        ("device", f"{plan.device.name}{tp}"),
        ("weights", f"{cap.weights_bytes:,} B ({_gib(cap.weights_bytes)}; {_gib(cap.weights_bytes_per_device)} per device)"),
        ("KV per token", f"{cap.kv_formula} ({cap.kv_dtype})"),
        ("activation reserve", f"{cap.activation_reserve_bytes:,} B ({_gib(cap.activation_reserve_bytes)})"),
        ("KV budget / device", f"{cap.kv_budget_bytes:,} B ({_gib(cap.kv_budget_bytes)}) = {budget}"),
        ("KV blocks", f"{cap.num_blocks:,} of {req.block_size} tokens ({cap.block_bytes:,} B each)"),
        ("blocks per sequence", f"{cap.blocks_per_seq:,} at {req.context:,} tokens; the last wastes "
                                f"{waste} tokens ({waste * cap.kv_bytes_per_token:,} B)"),
        ("max concurrent seqs", f"{cap.max_concurrent_seqs:,} at {req.context:,} tokens"),
    ]
    parts = [table([(k, v) for k, v in rows])]
    parts.append("\nscenario presets (block size the guide recommends, at this context):")
    parts.append(table([(s.name, str(s.block_size), f"{s.capacity.max_concurrent_seqs:,}",
                         str(s.capacity.last_block_waste_tokens), s.reason) for s in plan.scenarios],
                       ("scenario", "block", "max seqs", "waste", "why")))
    if plan.sizing is not None:
        s = plan.sizing
        needed = f"{s.devices_needed} x {plan.device.name}" if s.devices_needed else "out of reach"
        parts.append("\nhardware sizing (roofline):")
        parts.append(table([
            ("decode step", f"{s.decode_step_s * 1e3:,.2f} ms for {s.seqs_per_replica} seqs per replica "
                            f"({s.decode_bound} bound)"),
            ("decode per replica", f"{s.decode_tokens_per_s_per_replica:,.0f} tokens/s"),
            ("prefill per replica", f"{s.prefill_tokens_per_s_per_replica:,.0f} tokens/s (compute bound)"),
            ("devices needed", f"{needed} ({s.achieved_tokens_per_s:,.0f} tokens/s)"),
            ("the guide's table", s.guide),
        ]))
        if s.note:
            parts.append(f"note: {s.note}")
    parts.extend(f"warning: {w}" for w in plan.warnings)
    return "\n".join(parts)
