"""Row-count-aware fp32 linear layers for decoding: the fastest GEMM formulation per row count.

Decoding runs every linear layer on a handful of rows: one at a greedy step, 2-8 when a
speculative round verifies a tree, a few in a draft level. At such sizes a forward is
memory-bound (the weights are read once per call), yet the BLAS routine a stock
``F.linear(x, W)`` lands on can read them far below the memory bandwidth: on a 2-core AMD
EPYC with MKL, one sweep of ``x @ W.T`` over SmolLM2's 540 MB of linear weights takes
51 ms for one row (GEMV) and 75-110 ms for 2-4 rows, while the same product written
``(W @ x.T).T`` (the rows become the GEMM's narrow N dimension) takes 32-52 ms for 1-4 rows.
A single row is padded to two for that route: the duplicated row is free when the cost is
the weight read. On an Intel Xeon with the same MKL the stock kernel is the fast one for 1-3
rows, but slows sharply from 4 rows on, where MKL's *packed* GEMM (``cblas_sgemm_pack`` once,
``cblas_sgemm_compute`` per call: the layout MKL wants for a weight reused many times with a
small M, as PyTorch's own freezing pass uses it) grows far more slowly with the row count.

Which formulation wins depends on the BLAS, the CPU and the row count, so it is measured,
not assumed: ``measure_routes`` times each route for every row count on the module's own
weights (one sweep over all its linears per timing, so the weights come from memory as in
decoding, not from cache), routes interleaved, medians kept; ``load_or_measure`` caches the
table per (layer shapes, device, dtype, threads, torch, routes available). ``use_routes``
swaps each ``nn.Linear`` forward for the routed one and restores it on exit.

The routes compute the same dot products with a different summation order, so outputs
match ``F.linear`` to float rounding (not bit for bit); speculative decoding stays exact in
the sense ``actwave.decoding.speculative`` tests it: the target's greedy tokens, unless two
logits tie within rounding.
"""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import statistics
import time
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from actwave.config import artifact_dir, atomic_write_json
from actwave.decoding.timing import synchronize

ROUTES = ("linear", "weight_left", "packed")
ROW_COUNTS = tuple(range(1, 17)) + (24, 32, 48, 64)  # tree sizes beyond 16 come in steps


def weight_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` computed as (W @ X^T)^T; x: (..., d_in), weight: (d_out, d_in).

    One row is duplicated to two so BLAS takes its GEMM path, not its GEMV path (see the
    module docstring). Rows in and out are made contiguous: a strided input or a transposed
    output handed to the next layer sends BLAS down slower paths (measured: a 4-token
    SmolLM2 verification 77 -> 65 ms).
    """
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, d_in)
    single = rows.shape[0] == 1
    if single:
        rows = torch.cat([rows, rows])  # a real copy: a stride-0 expand falls off the fast path
    out = (weight @ rows.T).T.contiguous()  # (M, d_out)
    if single:
        out = out[:1]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


PACK_ROWS = 8  # MKL's packing hint (the row count it tunes the layout for); any count runs on it
_packed_weights: dict = {}  # id(weight) -> (weak reference to it, its version, packed copy)


def packing_available(weight: torch.Tensor) -> bool:
    """MKL's packed GEMM exists for float32 CPU weights in PyTorch builds with MKL."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of ``weight`` (d_out, d_in), made once and kept until
    ``release_packed`` or the weight's end (the entry is keyed by the tensor itself and its
    version, so an in-place update or a new tensor at a reused address packs again)."""
    key = id(weight)
    hit = _packed_weights.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == _version(weight):
        return hit[2]
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)
    _packed_weights[key] = (weakref.ref(weight, lambda _: _packed_weights.pop(key, None)),
                            _version(weight), packed)
    return packed


def _version(weight: torch.Tensor) -> int | None:
    """The in-place update counter; inference-mode tensors keep none (and cannot be updated
    in place outside inference mode)."""
    try:
        return weight._version
    except RuntimeError:
        return None


def release_packed(layers: list[torch.nn.Linear]) -> None:
    """Free the packed copies of these layers' weights (about the weights' size again)."""
    for layer in layers:
        _packed_weights.pop(id(layer.weight), None)


def packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through MKL's packed GEMM on ``packed_weight(weight)``; x: (..., d_in).
    Inference only (no autograd formula)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, d_in)
    out = torch.ops.mkl._mkl_linear(rows, packed_weight(weight), weight, bias, rows.shape[0])
    return out.reshape(*x.shape[:-1], weight.shape[0])


ROUTE_FUNCTIONS = {"linear": F.linear, "weight_left": weight_left, "packed": packed}


def available_routes(weight: torch.Tensor) -> tuple[str, ...]:
    """The routes that run on this weight's device and dtype."""
    return tuple(route for route in ROUTES if route != "packed" or packing_available(weight))


@dataclass
class RouteTable:
    """The fastest route per measured row count: ``routes[i]`` for ``rows[i]`` rows; a row
    count between two measured ones takes the route of the lower one; above the last (a
    prefill, a training batch: compute-bound, not what this is for) the stock
    ``linear``. ``seconds[route][i]``: median seconds of one sweep over all linears."""

    model: str
    device: str
    dtype: str
    threads: int
    rows: list[int]
    routes: list[str]
    seconds: dict[str, list[float]]

    def route(self, rows: int) -> str:
        if rows > self.rows[-1]:
            return "linear"
        return self.routes[bisect.bisect_right(self.rows, rows) - 1]


def linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    found = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    if not found:
        raise ValueError(f"{type(module).__name__} has no nn.Linear layers to route")
    return found


@torch.no_grad()
def measure_routes(module: torch.nn.Module, max_rows: int = 64, repeats: int = 5,
                   name: str = "") -> RouteTable:
    """Time every route available for the weights (``available_routes``) for the
    ``ROW_COUNTS`` up to ``max_rows`` on ``module``'s linears (each timing: one call per
    linear, the whole sweep), interleaved within each repeat, medians."""
    if max_rows < 1 or repeats < 1:
        raise ValueError(f"max_rows and repeats must be >= 1, got {max_rows}, {repeats}")
    layers = linears(module)
    weight = layers[0].weight
    counts = [m for m in ROW_COUNTS if m <= max_rows]
    inputs = {(m, d): torch.randn(m, d, dtype=weight.dtype, device=weight.device)
              for m in counts for d in {layer.in_features for layer in layers}}

    def sweep(route: str, rows: int) -> float:
        function = ROUTE_FUNCTIONS[route]
        synchronize(weight.device)
        tic = time.perf_counter()
        for layer in layers:
            function(inputs[(rows, layer.in_features)], layer.weight, layer.bias)
        synchronize(weight.device)
        return time.perf_counter() - tic

    routes = available_routes(weight)
    tasks = [(route, rows) for rows in counts for route in routes]
    for task in tasks:  # warm-up: first-call paths, thread pools
        sweep(*task)
    times: dict = {task: [] for task in tasks}
    for _ in range(repeats):
        for task in tasks:
            times[task].append(sweep(*task))
    seconds = {route: [statistics.median(times[(route, rows)]) for rows in counts]
               for route in routes}
    best = [min(routes, key=lambda route: seconds[route][i]) for i in range(len(counts))]
    release_packed(layers)
    return RouteTable(model=name, device=str(weight.device), dtype=str(weight.dtype),
                      threads=torch.get_num_threads(), rows=counts, routes=best, seconds=seconds)


def _cache_key(module: torch.nn.Module, name: str, max_rows: int) -> dict:
    """What the table depends on: the linear shapes, device, dtype, threads, torch, and the
    routes it chose among."""
    layers = linears(module)
    shapes = ",".join(f"{layer.out_features}x{layer.in_features}" for layer in layers)
    return {"model": name, "shapes": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "device": str(layers[0].weight.device), "dtype": str(layers[0].weight.dtype),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "max_rows": max_rows,
            "routes": list(available_routes(layers[0].weight))}


def load_or_measure(module: torch.nn.Module, name: str, max_rows: int = 64,
                    repeats: int = 5) -> RouteTable:
    """The cached ``RouteTable`` of this module on this machine, else measured and cached.

    name: a plain label for the cache folder (e.g. the model's slug, ``draft``)."""
    key = _cache_key(module, name, max_rows)
    path = artifact_dir("linear-routes", key, name=name) / "routes.json"
    if path.exists():
        try:
            return RouteTable(**json.loads(path.read_text())["table"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"corrupted linear-route cache {path} ({error}); delete it "
                             "to measure again") from error
    table = measure_routes(module, max_rows, repeats, name)
    atomic_write_json(path, {"key": key, "table": asdict(table)})
    return table


def _routed_forward(layer: torch.nn.Linear, table: RouteTable):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0:
            return F.linear(x, layer.weight, layer.bias)
        return ROUTE_FUNCTIONS[table.route(rows)](x, layer.weight, layer.bias)
    return forward


@contextlib.contextmanager
def use_routes(module: torch.nn.Module, table: RouteTable):
    """Within the block, every ``nn.Linear`` of ``module`` runs the route ``table`` picks
    for its row count; the stock forwards are restored on exit (also on error)."""
    unknown = sorted(set(table.routes) - set(ROUTES))
    if unknown:
        raise ValueError(f"route table names unknown routes {unknown}; allowed: {list(ROUTES)}")
    if active(module) is not None:
        raise ValueError(f"{type(module).__name__} already runs routed linears; nest use_routes "
                         "on distinct modules only")
    layers = linears(module)
    unusable = sorted(set(table.routes) - set(available_routes(layers[0].weight)))
    if unusable:
        raise ValueError(f"route table names routes {unusable} that do not run on "
                         f"{layers[0].weight.dtype} weights on {layers[0].weight.device}; "
                         f"available: {list(available_routes(layers[0].weight))}")
    if "packed" in table.routes:  # pack now, not inside the first timed call
        for layer in layers:
            packed_weight(layer.weight)
    for layer in layers:
        layer.forward = _routed_forward(layer, table)
    module._actwave_linear_routes = table
    try:
        yield table
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward
        release_packed(layers)
        del module._actwave_linear_routes


def active(module: torch.nn.Module) -> RouteTable | None:
    """The table ``module`` runs under (inside ``use_routes``), else None (stock)."""
    return getattr(module, "_actwave_linear_routes", None)


@contextlib.contextmanager
def routed(modules: dict[str, torch.nn.Module]):
    """``use_routes`` on each module with its cached (else measured) table; ``modules``:
    {cache label: module}, e.g. {"smollm2-135m": target, "draft": draft}. Yields
    {label: RouteTable}."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(use_routes(module, load_or_measure(module, name)))
               for name, module in modules.items()}
