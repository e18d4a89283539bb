"""The one decoding comparison behind every cited speedup: notebooks 07 and 09 and
``benchmarks/bench_speculative.py`` all call ``compare``.

On a CPU the product ``x @ Wᵀ`` for a few rows is far from the memory floor with the stock
kernel, so every row runs under the measured linear routes (``actwave.decoding.linear_routes``:
the faster GEMM formulation per row count, for the target and for each draft); plain greedy
decoding under the same routes is the speedup baseline, so speculative decoding is compared
with the fastest greedy we have. Two shapes are decoded, each in its own pass with its own
greedy reference on the same prompts:

- ``fixed``: the profile's tree (or chain) setting, with HF's greedy and prompt lookup as peers;
- ``auto``: the shape the cost model picks (``costmodel.auto_shape``) from this machine's
  measured cost curve — under the same routes — and the drafts' mean reach on greedy
  replies to held-out prompts of the benchmarks being decoded (the prompts after the timed
  ones; one shape shared by all drafts of a target, so layer sets are compared at one shape).

Each table row says which routes and which shape ran (columns ``routes``, ``shape``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import pandas as pd
import torch

from actwave.capture.models import slug
from actwave.decoding import costmodel, linear_routes
from actwave.decoding.evaluate import EvalConfig, evaluate
from actwave.decoding.tree import TreeShape

ROUTES = ("measured", "stock")


@dataclass
class Comparison:
    """What ``compare`` decoded: per pass the ``evaluate`` output and the shape with the cost
    model's prediction for it, the held-out reach the auto shape rests on ({top_k: [P(first
    d accepted)]}), the route tables used."""

    runs: dict[str, dict[str, pd.DataFrame]]
    shapes: dict[str, TreeShape]
    reach: dict[int, list[float]]
    routes: str
    tables: dict[str, linear_routes.RouteTable]

    def summary(self) -> pd.DataFrame:
        """Both passes' summaries, each row labelled with its pass, shape and routes."""
        table = pd.concat([run["summary"].assign(shape=self.shape_label(name), routes=self.routes,
                                                 pass_=name)
                           for name, run in self.runs.items()],
                          ignore_index=True).rename(columns={"pass_": "pass"})
        table["speedup_per_tau"] = table["speedup"] / table["tau"]  # share of τ the round cost keeps
        drafts = table["label"].isin(self.runs["fixed"]["drafts"])
        for column, field in (("predicted_speedup", "predicted_speedup"),
                              ("predicted_tau", "expected_tokens")):
            table[column] = table["pass"].map(
                {name: getattr(shape, field) for name, shape in self.shapes.items()}).where(drafts)
        # the prediction split as the measurement is (τ from the held-out reach, the share the
        # round cost keeps from the cost curve), so a miss shows its source
        table["predicted_speedup_per_tau"] = table["predicted_speedup"] / table["predicted_tau"]
        return table

    @property
    def auto(self) -> TreeShape:
        return self.shapes["auto"]

    def shape_label(self, name: str) -> str:
        """'tree 4/4/16' style label of a pass's shape (mode depth/top-k/total tokens)."""
        label = self.runs[name]["config"].shape().label()
        return f"auto: {label}" if name == "auto" else label


def held_out_texts(target, tokenizer, eos_token_ids, n_prompts: int, benchmarks,
                   skip: int) -> list[tuple[torch.Tensor, int]]:
    """Greedy replies to ``n_prompts`` held-out first turns of ``benchmarks`` (taken in turn
    from each, after the first ``skip`` of each: those an evaluation decodes)."""
    device = target.get_input_embeddings().weight.device
    prompts = [p.to(device) for p in costmodel.held_out_prompts(tokenizer, n_prompts, benchmarks,
                                                                skip)]
    return costmodel.greedy_texts(target, prompts, eos_token_ids=eos_token_ids)


def mean_reach(target, drafts: dict, texts) -> dict[int, list[float]]:
    """The drafts' mean reach on ``held_out_texts``: {top_k: [P(first d accepted)]}."""
    reaches = [costmodel.held_out_acceptance(target, draft, texts) for draft in drafts.values()]
    return {k: torch.tensor([r[k] for r in reaches]).mean(0).tolist() for k in reaches[0]}


@contextlib.contextmanager
def route_context(target, drafts: dict, routes: str, model: str):
    """Measured routes on the target and every draft (yields {label: RouteTable}), or
    nothing changed for ``routes="stock"`` (yields {})."""
    if routes not in ROUTES:
        raise ValueError(f"routes={routes!r}; allowed: {ROUTES}")
    if routes == "stock":
        yield {}
        return
    # drafts of one target share their linear shapes, so one cached table ("draft") serves all
    modules = {slug(model): (target, slug(model)),
               **{f"draft {label}": (draft, "draft") for label, draft in drafts.items()}}
    with contextlib.ExitStack() as stack:
        yield {label: stack.enter_context(linear_routes.use_routes(
            module, linear_routes.load_or_measure(module, cache_name)))
            for label, (module, cache_name) in modules.items()}


def compare(target, tokenizer, drafts: dict, config: EvalConfig, eos_token_ids, *,
            routes: str = "measured", acceptance_prompts: int = 16, lookup: bool = False,
            out_dir=None, run_name: str = "speculative") -> Comparison:
    """Decode ``config``'s prompts with the fixed shape of ``config`` (peers as configured)
    and with the auto shape (no peers), both under ``routes``.

    drafts: {label: Eagle3Draft of ``target``}. Records resume per pass in ``evaluate``'s
    run folders ``out_dir/<run_name>-<pass>-<key>/``. The auto shape rests on held-out
    prompts of ``config``'s own benchmarks, past the ones it decodes: fitted on the kind of
    text it is timed on, never on that text itself. lookup: the auto shape may add
    prompt-lookup rounds (``costmodel.auto_lookup``; the speed comparisons) — off where
    drafts are compared with each other, since lookup rounds do not use the draft.
    """
    if not drafts:
        raise ValueError("compare needs at least one draft")
    with route_context(target, drafts, routes, config.model) as tables:
        texts = held_out_texts(target, tokenizer, eos_token_ids, acceptance_prompts,
                               config.benchmarks, config.n_prompts)
        reach = mean_reach(target, drafts, texts)
        first = next(iter(drafts.values()))
        shapes = {"fixed": _predicted(target, first, reach, config),
                  "auto": costmodel.auto_shape(target, first, reach)}
        if lookup:
            shapes["auto"] = costmodel.auto_lookup(target, first, shapes["auto"], texts)
        configs = {"fixed": config,
                   "auto": dataclasses.replace(config, peers=False, **shapes["auto"].settings())}
        runs = {name: {**evaluate(target, tokenizer, drafts, pass_config, list(eos_token_ids),
                                  out_dir=out_dir, run_name=f"{run_name}-{name}"),
                       "config": pass_config, "drafts": list(drafts)}
                for name, pass_config in configs.items()}
    return Comparison(runs, shapes, reach, routes, tables)


def _predicted(target, draft, reach, config: EvalConfig) -> TreeShape:
    """The fixed shape of ``config`` with the cost model's prediction (NaN when the shape
    lies past the measured cost curves)."""
    shape = config.shape()
    try:
        return costmodel.predict(target, draft, reach, shape)
    except ValueError:
        return shape
