"""FP8 KV against full-precision KV on a real model, teacher-forced.

The same prompts go through the same model (SmolLM2-135M-Instruct, float32 weights) three times, each a single
prefill over a paged pool of another dtype: float32 (the reference), bfloat16 and fp8_e4m3. Every
query of a prefill reads its keys and values back from the pool (stored first, then attended), so
position ``p``'s logits see all ``p + 1`` cached tokens in the pool's dtype, exactly what a decode
step at that position would see. Teacher forcing: every pass is fed the same tokens, so the
positions compare one for one:

    top1_agreement = share of positions whose argmax equals the float32-KV argmax
    mean_kl        = mean over positions of KL(p_float32 || p_dtype), nats

bfloat16 is the 16-bit baseline measured in the same run (full runs): FP8 is judged against it and
against float32. ``max_flip_margin`` is the largest float32 top-1 lead (nats, over the runner-up) at
a position where the argmax changed: FP8 that only flips near-ties keeps it small. The run also
reports the relative error of the two FP8 scale granularities on the real K/V the float32 pass
stored (one scale per token and KV head, as the pool does, against one per block and KV head).

Two corpora (``--corpus``), chosen before measuring, nothing tuned to them:

    docs      (default) real running text, as KV-quantisation studies teacher-force on: the Python
              language reference shipped in the standard library (``pydoc_data.topics``, 79 topics,
              ~465K characters of English prose with some grammar and code), joined in topic order,
              tokenized once and cut into consecutive windows of ``positions`` tokens, of which
              ``prompts`` evenly spaced ones are taken (the i-th of n: window i x total // n)
    shuffled  seeded shuffles of the 40 unrelated sentences below: real sentences, incoherent text
              (the model is unsure of the next token: mean top-1 probability ~0.36)

``mean_top1_prob`` (the float32 pass's mean probability of its own argmax) says how sure the
model is of each corpus: where it is unsure, argmaxes are near-ties that any rounding flips.

``bench/fp8_kv_variants.py`` emulates what could lift FP8's agreement without a kernel change
(per-channel smoothing, centring, exact layers, an int8 code for reference).

    python bench/fp8_accuracy.py [--quick] [--json] [--corpus docs|shuffled] [--model DIR]
                                 [--prompts N] [--positions N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.plan_vs_measured import cpu_model  # noqa: E402

SENTENCES = [
    "The river rose quickly after three days of heavy rain in the mountains.",
    "She opened the old wooden box and found a stack of letters tied with string.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The committee postponed its decision until the budget report was finished.",
    "A good recipe for bread needs flour, water, salt, yeast and a lot of patience.",
    "In 1969 two astronauts walked on the surface of the Moon for the first time.",
    "The compiler reported an error on line forty-two: a missing closing bracket.",
    "Our train was delayed because a tree had fallen across the tracks near the station.",
    "Prime numbers have exactly two divisors: one and the number itself.",
    "He practised the violin every morning before the rest of the house woke up.",
    "The museum's new exhibition shows maps drawn by sailors in the sixteenth century.",
    "Cats sleep for twelve to sixteen hours a day, mostly in short naps.",
    "To reset the router, hold the button on the back for ten seconds.",
    "The glacier has retreated almost two kilometres since the first survey was made.",
    "A balanced diet includes vegetables, fruit, grains, protein and some healthy fats.",
    "The detective noticed that the clock on the mantelpiece had stopped at midnight.",
    "Interest rates affect how much it costs to borrow money for a house or a car.",
    "The children built a sandcastle with towers, a moat and a little flag on top.",
    "Water boils at one hundred degrees Celsius at sea level, and lower on a mountain.",
    "The library will be closed on Monday for the installation of new shelves.",
    "Volcanoes form where magma from deep inside the Earth reaches the surface.",
    "The orchestra tuned their instruments while the audience found their seats.",
    "A database index makes lookups faster at the cost of slower writes and more space.",
    "The farmer checked the weather forecast before deciding when to harvest the wheat.",
    "Shakespeare wrote thirty-seven plays, among them Hamlet, Macbeth and King Lear.",
    "The startup hired five engineers to rebuild its payment system from scratch.",
    "Migrating birds use the stars, the sun and the Earth's magnetic field to navigate.",
    "Please send me the quarterly figures by Friday so I can prepare the presentation.",
    "The bridge was painted bright red so that ships could see it through the fog.",
    "Vaccines train the immune system to recognise a virus before an infection.",
    "The chess player sacrificed her queen and won the game four moves later.",
    "Every function in this module returns a new list instead of changing its input.",
    "The old lighthouse keeper wrote down the weather in a notebook every evening.",
    "Electric cars convert most of the energy in their batteries into motion.",
    "The soup needs more salt, a little pepper and a handful of fresh parsley.",
    "Tectonic plates move only a few centimetres each year, about as fast as nails grow.",
    "The meeting ran long because everyone wanted to discuss the new office layout.",
    "He translated the poem from Spanish, keeping its rhythm as well as its meaning.",
    "Honey never spoils: jars found in ancient tombs were still safe to eat.",
    "The software update fixed the battery drain but introduced a new display bug.",
]
FULL = dict(prompts=64, positions=256, dtypes=("float32", "bfloat16", "fp8_e4m3"))
QUICK = dict(prompts=16, positions=256, dtypes=("float32", "fp8_e4m3"))  # ~1.5 min on 2 cores: no bf16 baseline
BLOCK_SIZE = 16
PROMPTS_PER_PASS = 8  # sequences packed into one prefill


def shuffled_prompts(tokenizer, count: int, positions: int, seed: int = 0) -> list[list[int]]:
    """``count`` token lists of exactly ``positions`` tokens: each a seeded shuffle of the sentences
    (repeated until long enough), so every prompt is different real text."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < positions:
            sentences = SENTENCES[:]
            rng.shuffle(sentences)
            ids += tokenizer.encode(" ".join(sentences) + " ")
        prompts.append(ids[:positions])
    return prompts


def docs_prompts(tokenizer, count: int, positions: int) -> list[list[int]]:
    """``count`` windows of ``positions`` consecutive tokens of the Python language reference
    (``pydoc_data.topics``, topics in sorted order), evenly spaced over the whole text."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[name] for name in sorted(topics)))
    total = len(ids) // positions
    if total < count:
        raise SystemExit(f"fp8_accuracy: the docs corpus has {total} windows of {positions} tokens; asked for {count}")
    return [ids[w * positions:(w + 1) * positions] for w in (i * total // count for i in range(count))]


CORPORA = {"docs": docs_prompts, "shuffled": shuffled_prompts}  # (tokenizer, count, positions) → prompts


def forward_all_positions(model, pool: tuple, prompts: list[list[int]], positions: int):
    """Log-probabilities ``[len(prompts) * positions, vocab]`` of one packed prefill of ``prompts``
    over the paged pool ``(kv_cache, kv_scales)``; sequence i owns blocks ``i * n .. (i + 1) * n - 1``."""
    import torch

    from kernels.metadata import AttentionMetadata, layer_caches

    kv_cache, kv_scales = pool
    n = len(prompts)
    blocks_per_seq = -(-positions // BLOCK_SIZE)
    tables = torch.arange(n * blocks_per_seq, dtype=torch.int32).view(n, blocks_per_seq)
    slots = (tables.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten(1)[:, :positions]
    meta = AttentionMetadata.prefill_only(
        tables, torch.full((n,), positions, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32) * positions,
        slots.flatten())
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.arange(positions).repeat(n)
    with torch.inference_mode():
        logits = model(ids, pos, layer_caches(kv_cache, kv_scales), meta, torch.arange(n * positions))
    return torch.log_softmax(logits.float(), dim=-1)


def scale_granularity_error(kv_cache) -> dict[str, float]:
    """Relative RMS error of FP8 on real K/V ``[L, 2, blocks, Hkv, bs, D]`` (float32), per
    (token, KV head) scale against one scale per (block, KV head)."""
    import torch

    fmax = torch.finfo(torch.float8_e4m3fn).max
    x = kv_cache.float()

    def error(amax):
        scale = (amax / fmax).clamp(min=torch.finfo(torch.float32).tiny)
        back = (x / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() * scale
        return float((back - x).pow(2).sum().sqrt() / x.pow(2).sum().sqrt())

    return {"rel_err_per_token_scale": error(x.abs().amax(dim=-1, keepdim=True)),
            "rel_err_per_block_scale": error(x.abs().amax(dim=(-2, -1), keepdim=True))}


def run(model_dir: Path, num_prompts: int, positions: int, dtypes: tuple[str, ...], corpus: str = "docs") -> dict:
    import torch

    from compute_service.kv.pool import allocate_kv_cache, kv_cache_dtype
    from compute_service.model.config import ModelConfig
    from compute_service.model.cpu_linear import pack_linears
    from compute_service.model.tokenizer import Tokenizer
    from compute_service.model.weights import load_model

    mc = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    model = load_model(model_dir, mc, torch.float32, cpu)
    per_pass = min(PROMPTS_PER_PASS, num_prompts)
    pack_linears(model, per_pass * positions)  # the engine's oneDNN-packed linears
    prompts = CORPORA[corpus](Tokenizer(model_dir), num_prompts, positions)
    num_blocks = per_pass * -(-positions // BLOCK_SIZE)
    pools = {name: allocate_kv_cache(mc, num_blocks, BLOCK_SIZE, kv_cache_dtype(name, "float32", cpu), cpu)
             for name in dtypes}
    # per compared dtype: [positions that agree, sum of KL, largest flipped lead]; one batch of
    # log-probabilities at a time (all of them would be prompts x positions x vocab floats)
    tally = {name: [0, 0.0, 0.0] for name in dtypes[1:]}
    top1_prob = 0.0  # sum over positions of the float32 pass's top-1 probability
    started = time.perf_counter()
    for i in range(0, num_prompts, per_pass):
        ref = forward_all_positions(model, pools["float32"], prompts[i:i + per_pass], positions)
        if i == 0:
            granularity = scale_granularity_error(pools["float32"][0])
        ref_top = ref.argmax(-1)
        top2 = ref.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        top1_prob += float(top2[:, 0].exp().sum())
        for name in dtypes[1:]:
            got = forward_all_positions(model, pools[name], prompts[i:i + per_pass], positions)
            flipped = got.argmax(-1) != ref_top
            tally[name][0] += int((~flipped).sum())
            tally[name][1] += float((ref.exp() * (ref - got)).sum(-1).sum())
            if flipped.any():
                tally[name][2] = max(tally[name][2], float(margin[flipped].max()))
    compared = num_prompts * positions
    result: dict = {"model": model_dir.name, "corpus": corpus, "prompts": num_prompts, "positions": positions,
                    "compared_positions": compared, "dtypes": list(dtypes),
                    "mean_top1_prob": top1_prob / compared, "python": sys.version.split()[0]}
    for name, (agree, kl, lead) in tally.items():
        result[name] = {"top1_agreement": agree / compared, "mean_kl": kl / compared, "max_flip_margin": lead}
    fp8 = result["fp8_e4m3"]
    result.update(top1_agreement=fp8["top1_agreement"], mean_kl=fp8["mean_kl"], **granularity,
                  kv_bytes_per_token={name: _bytes_per_token(mc, name) for name in dtypes},
                  cpu=cpu_model(), seconds=round(time.perf_counter() - started, 1))
    return result


def _bytes_per_token(mc, name: str) -> int:
    from compute_service.kv.cache_dtype import kv_bytes_per_token

    return kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, name)


def model_dir_or_none(arg: str | None, prog: str) -> Path | None:
    """The model directory ``--model`` names (default: the pulled SmolLM2), or None where it holds
    no model (said in one line on stderr)."""
    from kvfleet_cli.models_pull import default_model_dir

    model_dir = Path(arg) if arg else default_model_dir()
    if not (model_dir / "config.json").is_file():
        print(f"{prog}: {model_dir} is not a model directory (`make model` pulls SmolLM2)", file=sys.stderr)
        return None
    return model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="16 prompts x 256 positions, without the bfloat16 baseline (the full run: 64 x 256)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="docs",
                        help="docs: windows of the Python language reference (real text, the default); "
                             "shuffled: seeded shuffles of 40 unrelated sentences")
    parser.add_argument("--model", default=None, help="model directory (default: the pulled SmolLM2)")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--positions", type=int, default=None)
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    model_dir = model_dir_or_none(args.model, "fp8_accuracy")
    if model_dir is None:
        return 2
    result = run(model_dir, args.prompts or shape["prompts"], args.positions or shape["positions"], shape["dtypes"],
                 args.corpus)
    print(f"{result['model']}, corpus {result['corpus']}: {result['prompts']} prompts x {result['positions']} positions "
          f"({result['compared_positions']} compared), teacher-forced against float32 KV, {result['cpu']}")
    print(f"mean top-1 probability (float32 KV): {result['mean_top1_prob']:.3f}")
    print("| KV dtype | bytes/token | top-1 agreement | mean KL (nats) | largest flipped lead (nats) |")
    print("|---|---|---|---|---|")
    print(f"| float32 | {result['kv_bytes_per_token']['float32']} | (reference) | 0 | |")
    for name in result["dtypes"][1:]:
        r = result[name]
        print(f"| {name} | {result['kv_bytes_per_token'][name]} | {r['top1_agreement']:.2%} | {r['mean_kl']:.2e} "
              f"| {r['max_flip_margin']:.2f} |")
    print(f"FP8 scale granularity on the real K/V: relative RMS error {result['rel_err_per_token_scale']:.4f} "
          f"per (token, KV head) vs {result['rel_err_per_block_scale']:.4f} per (block of {BLOCK_SIZE}, KV head)")
    print(f"fp8_e4m3: top-1 agreement {result['top1_agreement']:.2%} (target >= 99%), "
          f"{result['kv_bytes_per_token']['fp8_e4m3'] / result['kv_bytes_per_token']['float32']:.3f}x "
          f"the bytes of float32 KV; {result['seconds']} s")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
