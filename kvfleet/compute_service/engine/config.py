"""``EngineConfig``: the engine's settings, each declared once with its type, default, help and rule
(``kvfleet.core.settings``). ``kvfleet compute`` and ``kvfleet up`` generate their flags from it, a config
file's keys are its names, and ``LLMEngine`` takes it as it is. Pure: no torch, so the command line
checks a value before anything heavy loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvfleet.compute_service.engine.cpu_host import host_cpu_flags, resolve_dtype
from kvfleet.compute_service.engine.swap_cost import PREEMPTION_MODES
from kvfleet.compute_service.kv.block_size import BLOCK_SIZE_PRESETS, parse_block_size
from kvfleet.compute_service.kv.cache_dtype import KV_CACHE_DTYPES
from kvfleet.compute_service.kv.layout import KV_LAYOUTS
from kvfleet.compute_service.kv.tier_flags import check_tier_flags
from kvfleet.core.settings import check, setting

DTYPES = ("auto", "float32", "bfloat16", "float16")
_PRESETS = ", ".join(f"{name} {size}" for name, size in BLOCK_SIZE_PRESETS.items())


@dataclass(slots=True)
class EngineConfig:
    """the engine: KV pool, dtypes, batching (every node of a cluster takes the same)"""

    block_size: int = setting(256, f"tokens per KV block: a multiple of 16 in 16-2048, or a preset ({_PRESETS})",
                              parse=parse_block_size, metavar="N|" + "|".join(BLOCK_SIZE_PRESETS))
    kv_cache_memory: int | None = setting(None, "bytes of KV pool", unset="a quarter of free memory",
                                          at_least=1, metavar="BYTES")
    dtype: str = setting("auto", "compute dtype: auto is bfloat16 on a CPU with native bfloat16 (AMX, AVX512-BF16), "
                         "else float32 (resolved on construction; KVFLEET_DEFAULT_DTYPE=float32|bfloat16 fixes it); float32 is "
                         "token-exact against transformers",
                         choices=DTYPES)
    kv_cache_dtype: str = setting("auto", "KV pool dtype: auto (= --dtype), or fp8_e4m3 (float8_e4m3fn with a "
                                  "float32 scale per token and KV head: about half of bfloat16)",
                                  choices=KV_CACHE_DTYPES)
    device: str = setting("cpu", "torch device of the model and the pool (cpu, cuda, cuda:1)")
    max_num_seqs: int = setting(64, "most sequences running at once (the live cap of --p99-itl-target-ms stays "
                                "below it)", at_least=1, metavar="N")
    max_num_batched_tokens: int = setting(2048, "most tokens one step computes: decode tokens and prompt chunks "
                                          "(with --p99-itl-target-ms, a few per sequence keeps a burst of prompts "
                                          "out of one step)", at_least=1, metavar="N")
    long_prefill_token_threshold: int = setting(
        0, "a prompt with more than N tokens left to prefill is long: short prompts go first (one a step beyond N "
           "tokens), a long one takes N tokens a step alone and a block beside them, so a short prompt is not held "
           "for a long one's prefill (0: off, a step's whole budget)", at_least=0, metavar="N")
    max_model_len: int | None = setting(None, "longest sequence, prompt and output (at most the model's context "
                                        "length)", unset="the model's context length", at_least=1, metavar="N")
    kv_layout: str = setting("paged", "paged, or contiguous: each sequence reserves --max-model-len slots at "
                             "admission, no prefix sharing (the traditional baseline)", choices=KV_LAYOUTS)
    kv_host_memory: int = setting(0, "bytes of host memory for a cold KV tier below the pool: evicted blocks are "
                                  "demoted there and promoted back on a prefix hit (0: none)", at_least=0,
                                  metavar="BYTES")
    kv_disk_dir: str | None = setting(None, "directory of block files for a disk tier below host (the node's own: "
                                      "its block files are wiped at start; `kvfleet up` gives node N DIR/N); needs "
                                      "--kv-disk-bytes and --kv-host-memory", metavar="DIR")
    kv_disk_bytes: int = setting(0, "bytes of the disk tier", at_least=0, metavar="BYTES")
    preemption_mode: str = setting("auto", "a preempted sequence's KV: swapped to the host tier and back, "
                                   "recomputed, or auto (whichever the copy bandwidth and prefill speed measured "
                                   "at start say is cheaper)", choices=PREEMPTION_MODES)
    node_id: str = "local"
    share_prefix_across_tenants: bool = False

    def __post_init__(self) -> None:
        check(self)
        self.dtype = resolve_dtype(self.dtype, self.device.split(":")[0], host_cpu_flags(), os.environ)
        check_tier_flags(self.kv_host_memory, self.kv_disk_dir, self.kv_disk_bytes, self.preemption_mode)
