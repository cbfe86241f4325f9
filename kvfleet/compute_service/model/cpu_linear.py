"""Linear layers on CPU through oneDNN, with each weight reordered once at load time.

On the CPUs measured here (AMD EPYC, AVX-512) torch's default ``F.linear`` (MKL sgemm) reaches
~180 GFLOPS in float32, while oneDNN with a prepacked weight reaches 350–500 GFLOPS for the same
shapes, with float32 accumulation (differences ~1e-5, the same order as any change of summation
order). Decode and prefill on CPU are both bound by these matmuls, so this is the engine's
largest single CPU speed-up. ``KVFLEET_CPU_LINEAR=torch`` keeps torch's default.

oneDNN builds a primitive (JIT-compiled kernels, ~0.3-0.6 MiB of heap each, whatever the layer's
size) for every input shape it sees, and keeps it: torch's ideep cache and oneDNN's primitive cache
hold up to 1,024 each. A node's row count is the step's token count, which takes hundreds of values
over a day, so a node fed every batch size as it came grew by ~1 MiB a minute after its warm-up (32
MiB in a 30-minute soak, bounded only near 1,024 shapes: ~0.5 GiB). ``PackedLinear`` therefore hands
oneDNN only a few row counts (``padded_rows``): at most 32 shapes per layer, all met once at load
(``warm_up``), so the heap is flat from the first request on. The padding rows are zeros whose
outputs are dropped. One more shape is the step's whole token budget (``batch_hint``): a prefill
step that fills its budget is one call, not tiles joined by a copy (measured at 2,048 rows, two
threads: tiles cost 5-19% more in float32, 3-6% in bfloat16); and an MLP that takes such a step in
passes (its half or quarter, ``rows_per_pass``) has that pass as a shape of its two layers too
(``pass_rows``; only there: each shape warmed up at load costs a matmul of its rows per layer shape).

Why MLPs take passes: glibc serves an allocation of 32 MiB or more with a fresh ``mmap`` each time
(below that, once one such block has been freed, from its heap), and each of its 4 KiB pages then
faults when first written. bench-small's fused gate-up output for a 2,048-token float32 step is
exactly 32 MiB: 590,000 page faults a run, and that matmul ran at half the speed of the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
TILE_ROWS = 256  # more rows than this go to oneDNN in tiles of this many (and a padded remainder)
EXACT_ROWS = 16  # up to this many rows go as they are: decoding a small batch, every row is a sequence


def padded_rows(rows: int) -> int:
    """The row count oneDNN sees for ``rows`` (1..TILE_ROWS): one of 32 values. Up to 16 rows
    exactly; above, rounded up to a multiple of an eighth of the next power of two (20, 24, 28,
    32, 40, ..., 224, 256), so at most a quarter more rows, ~10% on average: on a CPU a matmul of
    this size costs in proportion to its rows (measured: 8 rows take ~1.5x the time of 5)."""
    if rows < 1 or rows > TILE_ROWS:
        raise ValueError(f"rows must be 1..{TILE_ROWS}, got {rows}")
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows - 1).bit_length()) // 8
    return -(-rows // step) * step


PASS_BYTES = 24 << 20  # an MLP pass's intermediate (gate and up) at most: under glibc's 32 MiB mmap ceiling


def whole_sizes(batch_hint: int) -> tuple[int, ...]:
    """The row counts above one tile an MLP pass may take in one call: the step's token budget, its
    half and its quarter."""
    return tuple(n for n in (batch_hint, batch_hint // 2, batch_hint // 4) if n > TILE_ROWS)


def rows_per_pass(row_bytes: int, whole: tuple[int, ...], budget: int = PASS_BYTES) -> int:
    """Rows of one MLP pass whose intermediate (``row_bytes`` a row) stays within ``budget``: the
    largest whole size that does, else a multiple of a tile."""
    fits = budget // row_bytes
    return next((n for n in sorted(whole, reverse=True) if n <= fits), max(TILE_ROWS, fits // TILE_ROWS * TILE_ROWS))


def row_tiles(rows: int, whole: tuple[int, ...] = ()) -> list[tuple[int, int, int]]:
    """``(start, rows, padded rows)`` of each oneDNN call for an input of ``rows`` rows; a whole
    size (``whole_sizes``) goes in one call."""
    if rows in whole:
        return [(0, rows, rows)]
    return [(start, min(TILE_ROWS, rows - start), padded_rows(min(TILE_ROWS, rows - start)))
            for start in range(0, rows, TILE_ROWS)]


def step_rows(batch_hint: int) -> Callable[[int], int]:
    """The rows oneDNN computes for a step of N tokens, padding included (``row_tiles``; a step of
    the whole ``batch_hint`` is one call): the scheduler trims a long prompt's chunk to fit them."""
    whole = (batch_hint,) if batch_hint > TILE_ROWS else ()

    def rows(n: int) -> int:
        return sum(padded for _, _, padded in row_tiles(n, whole)) if n > 0 else 0
    return rows


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight in oneDNN's blocked layout (packed for ``batch_hint`` rows;
    any number of rows works, handed to oneDNN as ``row_tiles`` says: see the module's docstring)."""

    def __init__(self, linear: nn.Linear, batch_hint: int, pass_rows: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        # a full step's rows, and an MLP's pass of them: one call each
        self.whole_rows = tuple(dict.fromkeys(n for n in (batch_hint, pass_rows) if n > TILE_ROWS))
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        outs = [self._rows(rows[start:start + n], padded)
                for start, n, padded in row_tiles(rows.shape[0], self.whole_rows)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.view(*x.shape[:-1], self.out_features)

    def _rows(self, x: torch.Tensor, padded: int) -> torch.Tensor:
        n = x.shape[0]
        if padded != n:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - n))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out if padded == n else out[:n]


def _supported(model: nn.Module) -> bool:
    if os.environ.get("KVFLEET_CPU_LINEAR", "").lower() == "torch":
        return False
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linears(model: nn.Module, batch_hint: int, thread_counts: tuple[int, ...] = ()) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how many. Leaves the
    model as it is (with a warning) where oneDNN cannot serve it. oneDNN builds its primitives for
    the intra-op thread count of the moment, so they are warmed up at each of ``thread_counts``
    the engine may switch between (``thread_governor.py``; none: at the current count)."""
    if not _supported(model):
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    dtype = next(model.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()

    def pack(parent: nn.Module, child: nn.Linear) -> PackedLinear:  # an MLP says its pass (MLP.pass_rows)
        pass_rows = parent.pass_rows(batch_hint, elem) if hasattr(parent, "pass_rows") else 0
        return PackedLinear(child, batch_hint, pass_rows)

    try:
        first = pack(targets[0][0], targets[0][2])
        first(torch.zeros(1, first.in_features, dtype=dtype))
    except (RuntimeError, AttributeError) as exc:
        log.warning("oneDNN linear layers unavailable (%s); using torch's default matmul", exc)
        return 0
    packed = []
    for i in range(len(targets)):  # one layer at a time: its unpacked weight goes as its packed one comes
        (parent, name, child), targets[i] = targets[i], None
        packed.append(first if i == 0 else pack(parent, child))
        setattr(parent, name, packed[-1])
    del child
    layers, current = packed, torch.get_num_threads()
    try:
        for threads in thread_counts or (current,):
            torch.set_num_threads(threads)
            warm_up(layers)
    finally:
        torch.set_num_threads(current)
    return len(packed)


def warm_up(layers: list[PackedLinear]) -> None:
    """Meet every row count oneDNN will see, once per layer shape, so that its primitives exist
    before the first request: the heap they take (~0.5 MiB each) is then taken at load, and a batch
    size first met a day later adds nothing."""
    shapes = {(m.in_features, m.out_features, m.bias is not None, m.packed_weight.dtype, m.whole_rows): m
              for m in layers}
    with torch.inference_mode():
        for (in_features, *_), layer in shapes.items():
            x = torch.zeros(max((TILE_ROWS, *layer.whole_rows)), in_features, dtype=layer.packed_weight.dtype)
            for rows in sorted({padded_rows(n) for n in range(1, TILE_ROWS + 1)} | set(layer.whole_rows)):
                layer(x[:rows])
