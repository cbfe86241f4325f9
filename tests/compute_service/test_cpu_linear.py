"""oneDNN linear layers: same results as ``nn.Linear`` for any row count, and a heap that does not
grow with the number of different row counts served (the soak: a node grew ~1 MiB a minute
because oneDNN keeps a primitive of ~0.5 MiB for every input shape it meets)."""

import pytest
import torch

from kvfleet.compute_service.model.cpu_linear import (
    TILE_ROWS,
    PackedLinear,
    pack_linears,
    padded_rows,
    row_tiles,
    rows_per_pass,
    step_rows,
    whole_sizes,
)
from kvfleet.compute_service.node.mem_probe import malloc_info


def test_padded_rows_are_few_and_waste_little():
    padded = [padded_rows(n) for n in range(1, TILE_ROWS + 1)]
    assert len(set(padded)) <= 32
    assert padded[:16] == list(range(1, 17))  # small decoding batches go as they are
    assert all(0 <= p - n < n / 4 for n, p in zip(range(1, TILE_ROWS + 1), padded))
    with pytest.raises(ValueError):
        padded_rows(TILE_ROWS + 1)


def test_row_tiles_cover_every_row_once():
    for rows in (1, 17, TILE_ROWS, TILE_ROWS + 1, 3 * TILE_ROWS + 40):
        tiles = row_tiles(rows)
        assert [start for start, _, _ in tiles] == list(range(0, rows, TILE_ROWS))
        assert sum(n for _, n, _ in tiles) == rows
        assert all(padded == padded_rows(n) for _, n, padded in tiles)


def test_a_step_of_the_whole_budget_is_one_call():
    assert row_tiles(2048, whole=(2048, 1024, 512)) == [(0, 2048, 2048)]
    assert row_tiles(1024, whole=(2048, 1024, 512)) == [(0, 1024, 1024)]  # an MLP's pass (rows_per_pass)
    assert row_tiles(2047, whole=(2048, 1024, 512)) == row_tiles(2047)  # any other count: tiles
    assert PackedLinear(torch.nn.Linear(8, 8), 2048).whole_rows == (2048,)
    assert PackedLinear(torch.nn.Linear(8, 8), 2048, pass_rows=1024).whole_rows == (2048, 1024)  # an MLP's
    assert PackedLinear(torch.nn.Linear(8, 8), 2048, pass_rows=2048).whole_rows == (2048,)
    assert PackedLinear(torch.nn.Linear(8, 8), 64).whole_rows == ()  # within one tile anyway


def test_step_rows_are_the_rows_onednn_computes():
    rows = step_rows(2048)
    assert [rows(n) for n in (1, 16, 17, 128, 131, 160)] == [1, 16, 20, 128, 160, 160]
    assert rows(300) == TILE_ROWS + padded_rows(300 - TILE_ROWS)  # a tile and a padded remainder
    assert rows(2048) == 2048 and rows(0) == 0                     # the whole budget: one call
    assert step_rows(128)(TILE_ROWS + 3) == TILE_ROWS + 3           # a budget within a tile is never whole


def test_an_mlp_pass_keeps_its_intermediate_under_the_mmap_ceiling():
    whole = whole_sizes(2048)
    assert rows_per_pass(4096 * 2, whole) == 2048   # bench-small bfloat16: 16 MiB, one pass
    assert rows_per_pass(4096 * 4, whole) == 1024   # float32: 32 MiB at 2,048 rows, so halves
    assert rows_per_pass(28672 * 2, whole) == 256   # a 14,336-wide MLP in bfloat16: tiles
    assert rows_per_pass(4096 * 4, ()) == 1536      # unpacked: a multiple of a tile


@pytest.mark.parametrize("shape", [(1, 40), (7, 40), (17, 40), (TILE_ROWS, 40), (TILE_ROWS + 45, 40), (3, 5, 40),
                                   (600, 40)])
def test_packed_linear_matches_linear(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(40, 24)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected, got = linear(x), PackedLinear(linear, 600)(x)  # 600 rows: the whole budget, one call
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_packed_linear_with_no_rows():
    with torch.inference_mode():
        assert PackedLinear(torch.nn.Linear(40, 24), 64)(torch.zeros(0, 40)).shape == (0, 24)


def heap_growth_over_every_row_count(module: torch.nn.Module, in_features: int, most_rows: int = 300) -> float:
    """MiB the heap holds after ``module`` served each row count from 1 to ``most_rows`` once."""
    torch.manual_seed(0)
    inputs = [torch.randn(rows, in_features) for rows in range(1, most_rows + 1)]
    with torch.inference_mode():
        module(inputs[0])
        before = malloc_info()["in_use"]
        for x in inputs:
            module(x)
        return malloc_info()["in_use"] - before


def test_heap_does_not_grow_with_each_new_row_count():
    """Every row count from 1 to 300 once: oneDNN kept ~0.3-0.6 MiB per row count (166 MiB here)
    before inputs were padded to a few row counts. The layer's shape is one no other test uses, so
    that no earlier test has met its primitives."""
    layer = PackedLinear(torch.nn.Linear(72, 56, bias=False), 2048)
    grown = heap_growth_over_every_row_count(layer, 72)
    assert grown < 40, f"the heap grew {grown:.1f} MiB over 300 row counts"


def test_packed_model_meets_every_row_count_at_load():
    """After ``pack_linears`` a node's first request of any size adds no oneDNN primitive (21 MiB
    here without the warm-up at load; shapes no other test uses, as above)."""
    model = torch.nn.Sequential(torch.nn.Linear(88, 48), torch.nn.Linear(48, 88))
    assert pack_linears(model, 2048) == 2
    grown = heap_growth_over_every_row_count(model, 88)
    assert grown < 5, f"the heap grew {grown:.1f} MiB over 300 row counts after the warm-up"


def test_an_mlp_in_passes_gives_what_one_pass_gives():
    from types import SimpleNamespace

    from kvfleet.compute_service.model.causal_lm import MLP

    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=64, intermediate_size=8192, mlp_bias=False, hidden_act="silu")
    mlp = MLP(config)  # 64 KiB of intermediate a row: passes of 256 rows
    x = torch.randn(600, 64)
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), mlp._pass(x), rtol=1e-5, atol=1e-6)
        assert mlp(x[:200]).shape == (200, 64)


def test_only_an_mlp_that_takes_passes_gets_their_shape():
    from types import SimpleNamespace

    from kvfleet.compute_service.model.causal_lm import MLP

    config = SimpleNamespace(hidden_size=64, intermediate_size=2048, mlp_bias=False, hidden_act="silu")  # bench-small's
    model = torch.nn.ModuleDict({"mlp": MLP(config), "head": torch.nn.Linear(64, 4096, bias=False)})
    assert pack_linears(model, 2048) == 3
    assert model["mlp"].gate_up_proj.whole_rows == model["mlp"].down_proj.whole_rows == (2048, 1024)  # float32
    assert model["head"].whole_rows == (2048,)
    x = torch.randn(2048, 64)
    with torch.inference_mode():
        torch.testing.assert_close(model["mlp"](x), model["mlp"]._pass(x), rtol=1e-5, atol=1e-6)
