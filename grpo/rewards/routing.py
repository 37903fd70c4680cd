"""Routing: each dataset's rewards (with weights and kwargs) applied to its own rows, checked and summed."""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

from grpo.errors import RewardError
from grpo.rewards.registry import RewardFn, get_reward


# ---------------------------------------------------------------------------------------------- routing
@dataclass
class RewardResult:
    """Rewards of one batch: the weighted total per row and each function's raw values."""
    total: list[float]                              # weighted sum per row
    per_function: dict[str, list[Optional[float]]]  # raw, unweighted; None where the function did not apply

    @property
    def reward_names(self) -> list[str]:
        """Every function the router knows, in route order, then extra functions."""
        return list(self.per_function)

    def means(self) -> dict[str, float]:
        """Mean raw value of each function over the rows it applied to (functions that applied to none: absent)."""
        out = {}
        for name, values in self.per_function.items():
            applied = [v for v in values if v is not None]
            if applied:
                out[name] = sum(applied) / len(applied)
        return out


class _Route(NamedTuple):
    name: str
    fn: RewardFn
    weight: float
    kwargs: dict


_ROW_ARGS = ("completions", "answers", "prompts", "data_source")  # passed by the router, never configurable
# passed only to functions that name them (or take **kwargs): rewards written before they existed keep working
OPTIONAL_ROW_ARGS = ("messages", "agent_results")


def _accepted_optional_args(fn) -> set[str]:
    """The OPTIONAL_ROW_ARGS `fn` takes: those it names, or all of them when it takes **kwargs."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a callable without a readable signature: give it everything, as before
        return set(OPTIONAL_ROW_ARGS)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return set(OPTIONAL_ROW_ARGS)
    return {p.name for p in parameters} & set(OPTIONAL_ROW_ARGS)


class RewardRouter:
    """Applies each dataset's rewards (with their weights) to its own rows, plus extra callables to every row.

    routes: {data_source: {reward_name: weight}}; reward_kwargs: {data_source: {reward_name: {kwarg: value}}};
    extra_funcs: callables applied to every row with weight 1.0, named by their __name__.
    """

    def __init__(self, routes: dict[str, dict[str, float]],
                 reward_kwargs: Optional[dict[str, dict[str, dict]]] = None, extra_funcs: Sequence[Callable] = ()):
        reward_kwargs = reward_kwargs or {}
        stray = sorted(set(reward_kwargs) - set(routes))
        if stray:
            raise RewardError(f"reward_kwargs name dataset(s) {', '.join(stray)} that have no rewards configured")
        self.routes: dict[str, list[_Route]] = {
            source: self._resolve(source, weights, reward_kwargs.get(source) or {})
            for source, weights in routes.items()}
        self.extra: list[_Route] = []
        taken = {route.name for entries in self.routes.values() for route in entries}
        for fn in extra_funcs:
            if not callable(fn):
                raise RewardError(f"extra reward functions must be callables, got {type(fn).__name__}")
            name = getattr(fn, "__name__", None) or type(fn).__name__
            if name in taken:
                raise RewardError(f"two reward functions are named '{name}' (its values would be logged under "
                                  f"one key); give the extra function another __name__")
            taken.add(name)
            self.extra.append(_Route(name, fn, 1.0, {}))

    @staticmethod
    def _resolve(source: str, weights, kwargs_by_reward) -> list[_Route]:
        """Look every name up now, so a typo fails before any model loads."""
        if not isinstance(weights, Mapping):
            raise RewardError(f"dataset '{source}': rewards must map reward names to weights, "
                              f"got {type(weights).__name__}")
        stray = sorted(set(kwargs_by_reward) - set(weights))
        if stray:
            raise RewardError(f"dataset '{source}': reward_kwargs given for {', '.join(stray)}, which is not among "
                              f"its rewards ({', '.join(weights)}); add it to \"rewards\" or drop its kwargs")
        entries = []
        for name, weight in weights.items():
            try:
                fn = get_reward(name)
            except RewardError as exc:
                raise RewardError(f"dataset '{source}': {exc}") from None
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise RewardError(f"dataset '{source}': the weight of '{name}' must be a finite number, "
                                  f"got {weight!r}")
            check_ready = getattr(fn, "check_ready", None)  # e.g. an optional package the reward needs
            if check_ready is not None:
                try:
                    check_ready()
                except RewardError as exc:
                    raise RewardError(f"dataset '{source}': {exc}") from None
            kwargs = dict(kwargs_by_reward.get(name) or {})
            reserved = sorted(set(kwargs) & set(_ROW_ARGS))
            if reserved:
                raise RewardError(f"dataset '{source}': reward_kwargs of '{name}' may not set {', '.join(reserved)}"
                                  f" (the router passes those per row)")
            entries.append(_Route(name, fn, float(weight), kwargs))
        return entries

    def __call__(self, completions: list[str], answers: list, data_sources: list[str],
                 prompts: Optional[list[str]] = None, **row_fields) -> RewardResult:
        """Score a batch: each function runs once per dataset on that dataset's rows (batched)."""
        n = len(completions)
        prompts = prompts if prompts is not None else [""] * n
        for field, values in {"answers": answers, "data_sources": data_sources, "prompts": prompts,
                              **row_fields}.items():
            if len(values) != n:
                raise RewardError(f"reward inputs: '{field}' has {len(values)} entries for {n} completions")
        unrouted = [i for i, source in enumerate(data_sources) if source not in self.routes]
        if unrouted:
            first = unrouted[0]
            raise RewardError(f"row {first} comes from dataset '{data_sources[first]}', which has no rewards "
                              f"configured (datasets with rewards: {', '.join(sorted(self.routes))})")
        total = [0.0] * n
        per_function: dict[str, list[Optional[float]]] = {}
        for route in [r for entries in self.routes.values() for r in entries] + self.extra:
            per_function.setdefault(route.name, [None] * n)
        columns = {"completions": completions, "answers": answers, "prompts": prompts, "data_source": data_sources,
                   **row_fields}
        for source, entries in self.routes.items():
            rows = [i for i, s in enumerate(data_sources) if s == source]
            if not rows:
                continue  # this dataset has no rows in the batch
            for route in entries:
                self._apply(route, source, rows, columns, total, per_function)
        if n:
            for route in self.extra:
                self._apply(route, "all datasets", list(range(n)), columns, total, per_function)
        return RewardResult(total, per_function)

    @staticmethod
    def _apply(route: _Route, source: str, rows: list[int], columns: dict, total: list[float],
               per_function: dict) -> None:
        """Call one function on `rows`, check what it returned, add weight * value to the totals."""
        accepted = _accepted_optional_args(route.fn)
        picked = {key: [values[i] for i in rows] for key, values in columns.items()
                  if key not in OPTIONAL_ROW_ARGS or key in accepted}
        clash = sorted(set(route.kwargs) & set(picked))
        if clash:
            raise RewardError(f"reward '{route.name}' (dataset '{source}'): its reward_kwargs {', '.join(clash)} "
                              f"clash with per-row fields of the same name; rename them")
        completions, answers = picked.pop("completions"), picked.pop("answers")
        try:
            values = route.fn(completions, answers, **picked, **route.kwargs)
        except Exception as exc:
            raise RewardError(f"reward '{route.name}' (dataset '{source}') raised {type(exc).__name__}: {exc} "
                              f"while scoring a batch of {len(rows)} rows") from exc
        if not isinstance(values, (list, tuple)) or len(values) != len(rows):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise RewardError(f"reward '{route.name}' (dataset '{source}') must return a list of {len(rows)} "
                              f"floats, one per completion; got {got}")
        column = per_function[route.name]
        for local, (row, value) in enumerate(zip(rows, values)):
            if not isinstance(value, numbers.Real) or not math.isfinite(value):  # bools count as 0 / 1
                raise RewardError(f"reward '{route.name}' (dataset '{source}') returned {value!r} for row {local} "
                                  f"of its batch (completion {row}: {str(completions[local])[:60]!r}); rewards "
                                  f"must be finite numbers")
            column[row] = float(value)
            total[row] += route.weight * float(value)
