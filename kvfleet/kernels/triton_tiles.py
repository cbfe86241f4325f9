"""What every paged-attention Triton kernel does per tile of ``BLOCK_N`` key positions, as
``@triton.jit`` helpers inlined into the kernels: read K/V in place through the block table, score
the tile against the query rows (soft-capped where the layer says so), fold it into the online
softmax (base-2 exponentials).

    positions t -> block_table[t // BLOCK_SIZE] -> tile [BLOCK_N, BLOCK_D] of (block, kv head)

FP8 rows are widened times their own scale, read from the scale caches ``[num_blocks, Hkv, block_size]``
at (block, kv head, t % BLOCK_SIZE).
"""

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_row_ptr, t, t_mask, head_base, d,
                 d_mask, stride_cb, stride_co, scale_head_base, stride_sb,
                 BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, USE_FP32: tl.constexpr):
    block = tl.load(block_row_ptr + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    # offsets: [BLOCK_N, BLOCK_D] into one (block, kv head) tile each row
    offs = block[:, None] * stride_cb + head_base + (t % BLOCK_SIZE)[:, None] * stride_co + d[None, :]
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
    if IS_FP8:
        # row scales: [BLOCK_N], one per (block, kv head, offset)
        scale_offs = block * stride_sb + scale_head_base + t % BLOCK_SIZE
        k = k.to(tl.float32) * tl.load(k_scale_ptr + scale_offs, mask=t_mask, other=0.0)[:, None]
        v = v.to(tl.float32) * tl.load(v_scale_ptr + scale_offs, mask=t_mask, other=0.0)[:, None]
        if not USE_FP32:  # tensor cores take FP8 tiles widened to bf16 (8 mantissa bits hold e4m3's 3)
            k = k.to(tl.bfloat16)
            v = v.to(tl.bfloat16)
    return k, v


@triton.jit
def tile_scores(q, k, softcap, USE_FP32: tl.constexpr, SOFTCAP: tl.constexpr):
    """``q @ k.T``: [rows, BLOCK_N]; float32 (the interpreter, float32 caches) or tensor cores. With
    ``SOFTCAP``, Gemma 2's logit soft-cap ``softcap * tanh(s / softcap)`` (``softcap`` in the scores'
    base-2 units), as ``softcap * (2 sigmoid(2 s / softcap) - 1)``: core ``triton.language`` has no tanh."""
    if USE_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q.to(k.dtype), tl.trans(k))
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    return s


@triton.jit
def online_softmax_update(s, v, m, l, acc, USE_FP32: tl.constexpr):
    """Fold masked scores ``s`` ([rows, BLOCK_N], -inf where masked) and their values into the
    running max ``m``, sum ``l`` and output ``acc``. A row that has seen no key yet stays empty."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    if USE_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc
