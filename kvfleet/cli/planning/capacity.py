"""How many sequences of a given context fit one device's KV pool, counted the way the engine
counts: the pool is ``budget // bytes_per_block`` blocks (``kvfleet.compute_service.kv.pool``) and a
sequence of ``n`` tokens holds ``ceil(n / block_size)`` of them. Pure.

    device memory x gpu_memory_utilization
      - weights (this device's share under tensor parallelism)
      - activation reserve (runtime + one step's activations + logits)
      = KV budget  ->  blocks = budget // (block_size x KV bytes/token)  ->  seqs = blocks // blocks/seq
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.cli.planning.devices import Device
from kvfleet.cli.planning.shapes import ModelShape
from kvfleet.compute_service.kv.cache_dtype import ELEMENT_BYTES, KV_CACHE_DTYPES, SCALE_BYTES
from kvfleet.core.block_size import check_block_size

KV_DTYPES = KV_CACHE_DTYPES  # the engine's --kv-cache-dtype names

# the guide's scenario presets (the engine's BLOCK_SIZE_PRESETS) and the reason each fits
SCENARIOS: tuple[tuple[str, int, str], ...] = (
    ("chat", 256, "short turns (1-2K tokens): the guide's 128-256 keeps the last block's waste small; "
                  "256 is a multiple of 64 and 1/8 of a 2K request"),
    ("code", 512, "repository context (4K+ tokens) shared across requests: 512 is 1/8 of 4K and "
                  "halves the block-table length of 256"),
    ("document", 1024, "long documents (8K-128K): 1024 is 1/8 of 8K; fewer, larger blocks to "
                       "transfer and index, waste under 1% at 128K"),
)


@dataclass(frozen=True, slots=True)
class CapacityRequest:
    context: int                          # tokens per sequence (prompt + output)
    block_size: int = 256
    kv_cache_dtype: str = "auto"
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None    # bytes of KV pool per device, given outright (no reserve)
    max_num_batched_tokens: int = 2048    # one step's tokens: sizes the activation reserve
    max_num_seqs: int = 256               # rows of logits in the activation reserve

    def __post_init__(self) -> None:
        if self.context < 1:
            raise ValueError(f"--context must be at least 1 token, got {self.context}")
        check_block_size(self.block_size, "--block-size")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"--tensor-parallel must be at least 1, got {self.tensor_parallel}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive bytes, got {self.kv_cache_memory}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be at least 1")


@dataclass(frozen=True, slots=True)
class Capacity:
    kv_dtype: str
    kv_bytes_per_token: int               # on one device (tensor parallelism splits GQA heads)
    kv_formula: str
    weights_bytes: int                    # the whole model
    weights_bytes_per_device: int
    activation_reserve_bytes: int
    kv_budget_bytes: int                  # per device; negative: the weights do not fit
    block_bytes: int
    num_blocks: int
    blocks_per_seq: int
    last_block_waste_tokens: int
    max_concurrent_seqs: int


def kv_dtype_bytes(shape: ModelShape, kv_cache_dtype: str) -> tuple[str, int]:
    name = shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return name, ELEMENT_BYTES[name]


def activation_reserve(shape: ModelShape, device: Device, request: CapacityRequest) -> int:
    """What a step needs besides weights and KV: the runtime (CUDA context, workspaces) plus one
    step's live activations — per token the residual, normed input, q/k/v and attention output
    (~4 x hidden) and the MLP's gate and up (2 x intermediate / TP), in the model's dtype — plus
    float32 logits for ``max_num_seqs`` rows. Deliberately simple: it is what the plan states,
    and ``--kv-cache-memory`` bypasses it."""
    _, act_bytes = kv_dtype_bytes(shape, "auto")
    per_token = 4 * shape.hidden_size + 2 * shape.intermediate_size // request.tensor_parallel
    step = request.max_num_batched_tokens * per_token * act_bytes
    logits = request.max_num_seqs * shape.vocab_size * 4
    return device.runtime_overhead + step + logits


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def capacity(shape: ModelShape, device: Device, request: CapacityRequest, block_size: int | None = None) -> Capacity:
    """The plan's memory arithmetic for one device (``block_size`` overrides the request's)."""
    block_size = block_size or request.block_size
    tp = request.tensor_parallel
    kv_dtype, item = kv_dtype_bytes(shape, request.kv_cache_dtype)
    per_token = shape.kv_elements_per_token(tp) * item
    formula = shape.kv_formula(item, tp)
    if kv_dtype in SCALE_BYTES and shape.mla is None:
        # the pool stores one scale per (token, KV head) row of K and of V (kvfleet.compute_service.kv.cache_dtype)
        rows = 2 * shape.num_layers * shape.kv_heads_per_device(tp)
        per_token += rows * SCALE_BYTES[kv_dtype]
        formula += f" + {rows} rows x {SCALE_BYTES[kv_dtype]} B scales = {per_token:,} B"
    weights = shape.weights_bytes()
    weights_per_device = -(-weights // tp)
    if request.kv_cache_memory is not None:
        reserve, budget = 0, request.kv_cache_memory
    else:
        reserve = activation_reserve(shape, device, request)
        budget = int(device.memory_bytes * request.gpu_memory_utilization) - weights_per_device - reserve
    block_bytes = block_size * per_token
    num_blocks = max(0, budget) // block_bytes
    per_seq = blocks_for(request.context, block_size)
    return Capacity(
        kv_dtype=kv_dtype, kv_bytes_per_token=per_token, kv_formula=formula,
        weights_bytes=weights, weights_bytes_per_device=weights_per_device, activation_reserve_bytes=reserve,
        kv_budget_bytes=budget, block_bytes=block_bytes, num_blocks=num_blocks, blocks_per_seq=per_seq,
        last_block_waste_tokens=per_seq * block_size - request.context, max_concurrent_seqs=num_blocks // per_seq)
