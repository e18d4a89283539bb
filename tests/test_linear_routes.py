"""Row-count-aware linear routes: each route equals F.linear, the measured table is cached and
used, the stock forwards come back, and speculative decoding under routes equals greedy."""
import json

import pytest
import torch
import torch.nn.functional as F

from actwave.decoding import costmodel, linear_routes
from actwave.decoding.linear_routes import ROUTE_FUNCTIONS, ROUTES, RouteTable
from actwave.decoding.speculative import generate, greedy_generate
from actwave.decoding.tree import TreeShape
from actwave.eagle3 import Eagle3Draft


def table_of(route: str, rows=(1, 2, 4, 8)) -> RouteTable:
    return RouteTable(model="tiny", device="cpu", dtype="torch.float32", threads=1, rows=list(rows),
                      routes=[route] * len(rows), seconds={r: [1.0] * len(rows) for r in ROUTES})


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 3, 24), (2, 5, 24), (70, 24), (24,)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_route_equals_f_linear(route, shape, bias):
    if route == "packed" and not linear_routes.packing_available(torch.zeros(1)):
        pytest.skip("this PyTorch build has no MKL")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator)
    weight = torch.randn(40, 24, generator=generator)
    b = torch.randn(40, generator=generator) if bias else None
    out = ROUTE_FUNCTIONS[route](x, weight, b)
    assert out.shape == (*shape[:-1], 40)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


requires_packing = pytest.mark.skipif(
    not linear_routes.packing_available(torch.zeros(1)), reason="this PyTorch build has no MKL")


@requires_packing
def test_packed_weight_is_made_once_and_again_after_an_update():
    weight = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    first = linear_routes.packed_weight(weight)
    assert linear_routes.packed_weight(weight) is first
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        weight.mul_(2.0)  # an in-place update: the old packed copy would give the old product
    assert linear_routes.packed_weight(weight) is not first
    torch.testing.assert_close(linear_routes.packed(x, weight, None), F.linear(x, weight),
                               rtol=1e-5, atol=1e-5)


@requires_packing
def test_packed_copies_live_only_inside_use_routes(llama):
    layers = linear_routes.linears(llama)
    with linear_routes.use_routes(llama, table_of("packed")):
        assert all(id(layer.weight) in linear_routes._packed_weights for layer in layers)
    assert not any(id(layer.weight) in linear_routes._packed_weights for layer in layers)


@requires_packing
def test_packed_route_is_refused_where_it_cannot_run(llama):
    assert "packed" in linear_routes.available_routes(llama.lm_head.weight)
    assert "packed" not in linear_routes.available_routes(llama.lm_head.weight.bfloat16())
    half = torch.nn.Linear(8, 8).bfloat16()
    with pytest.raises(ValueError, match=r"routes \['packed'\] that do not run on torch.bfloat16"):
        with linear_routes.use_routes(half, table_of("packed")):
            pass


def test_route_lookup_between_and_beyond_measured_rows():
    table = RouteTable(model="tiny", device="cpu", dtype="torch.float32", threads=1,
                       rows=[1, 2, 3, 4, 6, 8], routes=["weight_left"] * 4 + ["linear", "weight_left"],
                       seconds={r: [1.0] * 6 for r in ROUTES})
    assert [table.route(m) for m in (1, 4, 5, 6, 7, 8)] == ["weight_left"] * 3 + ["linear"] * 2 + ["weight_left"]
    assert table.route(9) == "linear"  # above the measured rows: a prefill keeps stock F.linear


def test_use_routes_routes_and_restores(llama, monkeypatch):
    ids = torch.randint(0, llama.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = llama(input_ids=ids).logits
    calls = []
    original = ROUTE_FUNCTIONS["weight_left"]
    monkeypatch.setitem(ROUTE_FUNCTIONS, "weight_left", lambda *args: calls.append(1) or original(*args))
    with linear_routes.use_routes(llama, table_of("weight_left", (1, 2, 4))) as table, \
            torch.no_grad():
        assert linear_routes.active(llama) is table
        routed = llama(input_ids=ids[:, :4]).logits  # 4 rows: routed
        assert len(calls) == len(linear_routes.linears(llama))
        llama(input_ids=ids)  # 7 rows: above the table, stock
        assert len(calls) == len(linear_routes.linears(llama))
    assert linear_routes.active(llama) is None
    assert all("forward" not in layer.__dict__ for layer in linear_routes.linears(llama))
    torch.testing.assert_close(routed, stock[:, :4], rtol=1e-4, atol=1e-5)


def test_use_routes_refuses_unknown_routes_and_nesting(llama):
    with pytest.raises(ValueError, match=r"unknown routes \['gemv'\]; allowed"):
        with linear_routes.use_routes(llama, table_of("gemv")):
            pass
    with linear_routes.use_routes(llama, table_of("linear")):
        with pytest.raises(ValueError, match="already runs routed linears"):
            with linear_routes.use_routes(llama, table_of("linear")):
                pass
    assert linear_routes.active(llama) is None


def test_a_module_without_linears_is_refused():
    with pytest.raises(ValueError, match="LayerNorm has no nn.Linear layers"):
        linear_routes.measure_routes(torch.nn.LayerNorm(4))


def test_measured_table_is_cached_and_picks_the_faster_route(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path))
    table = linear_routes.load_or_measure(llama, "tiny-llama", max_rows=5, repeats=1)
    assert table.rows == [1, 2, 3, 4, 5] and set(table.routes) <= set(ROUTES)
    assert set(table.seconds) == set(linear_routes.available_routes(llama.lm_head.weight))
    for i, route in enumerate(table.routes):  # the table keeps the fastest median
        assert table.seconds[route][i] == min(seconds[i] for seconds in table.seconds.values())
    monkeypatch.setattr(linear_routes, "measure_routes", lambda *a, **k: pytest.fail("re-measured"))
    assert linear_routes.load_or_measure(llama, "tiny-llama", max_rows=5, repeats=1) == table


def test_corrupted_route_cache_is_named(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path))
    linear_routes.load_or_measure(llama, "tiny-llama", max_rows=2, repeats=1)
    path = next(tmp_path.glob("linear-routes/*/routes.json"))
    path.write_text(json.dumps({"key": {}, "table": {"rows": [1]}}))
    with pytest.raises(ValueError, match="corrupted linear-route cache .*delete it"):
        linear_routes.load_or_measure(llama, "tiny-llama", max_rows=2, repeats=1)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_under_routes_equals_greedy(target, route, mode):
    """Target and draft both routed (every row count up to 64): the output is still the
    target's greedy decoding, which is itself the same as with stock linears."""
    ids = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(target, (1, 2, 4), draft_vocab_size=96).eval()
    stock = greedy_generate(target, ids, 20).tokens
    shape = TreeShape("chain", depth=4) if mode == "chain" else TreeShape("tree", 3, 3, 8)
    rows = list(linear_routes.ROW_COUNTS)
    with linear_routes.use_routes(target, table_of(route, rows)), \
            linear_routes.use_routes(draft, table_of(route, rows)):
        assert greedy_generate(target, ids, 20).tokens == stock
        assert generate(target, draft, ids, 20, shape=shape).tokens == stock


def test_cost_curve_key_names_the_routes(llama):
    draft = Eagle3Draft.from_target(llama, (1, 4), draft_vocab_size=64).eval()
    stock_key = costmodel._cache_key(llama, draft, 12, 5, 2)
    assert "linear_routes" not in stock_key  # stock curves keep their pre-routes cache key
    with linear_routes.use_routes(llama, table_of("weight_left")):
        routed_key = costmodel._cache_key(llama, draft, 12, 5, 2)
    assert routed_key["linear_routes"] == {"target": ["weight_left"] * 4, "draft": "stock"}
