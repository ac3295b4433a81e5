"""Full cache: the uncompressed reference every table compares against."""

from __future__ import annotations

from .base import Budget, CompressResult, HeadLayout, LayerContext, Method, Plan


class FullCache(Method):
    """Keeps every token (no config fields); ``plan`` always says no compression."""

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        return Plan(layer_budgets=[n_tokens] * layout.num_layers, compress=False)

    def min_budget(self) -> int:
        return 0

    def compress(self, ctx: LayerContext) -> CompressResult:
        return CompressResult(keys=ctx.keys, values=ctx.values)
