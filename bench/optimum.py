"""The least KV any plan of a small layout makes its most-loaded rank receive, by integer programming.

The lower bound (``doccp.plan.bound``) claims that no plan with tokens per rank within one and work
max/mean <= the tolerance receives less than it says. Exhaustive search checks that claim on layouts of
about ten tokens (``tests/test_plan.py``); this script checks it on layouts of a hundred, where several
documents compete for the same cheap fill, with a mixed-integer program solved by HiGHS through SciPy
(``scipy.optimize.milp``; SciPy is not a dependency of doccp, so this is a tool, not a test).

Variables: ``x[t, r]`` (binary) puts token ``t`` on rank ``r``; ``y[t, r]`` (continuous, in [0, 1]) says
rank ``r`` needs key ``t``: under a causal mask ``y[t, r] >= y[t + 1, r]`` within a document and
``y[t, r] >= x[t, r]`` (a rank needs every key up to its highest row), under the full mask ``y[t, r] >=
x[u, r]`` for every ``u`` of the document. Each rank receives ``sum_t y[t, r] - x[t, r] <= z``;
minimise ``z``. The first token sits on rank 0 (ranks are interchangeable).

    python bench/optimum.py --lengths 22,22,3,3,3,3,3 -n 3        # 11 (the bound says 8)

A solve cut short by ``--time-limit`` prints the best plan found and the solver's own lower bound:
the optimum lies between them, and a bound above the best plan found is wrong.

Layouts of real size are too big for the program. ``--pattern`` instead fixes which rank holds each
run of every document, in row order (``;`` between documents), and solves the runs' boundaries
(continuous, by SLSQP from ``--starts`` random points; causal mask). SLSQP is a local method, so the
least max KV it finds is that of *a* plan with the pattern, not the best one: an upper bound on the
optimum, to set beside the planner's plan and the lower bound::

    python bench/optimum.py --lengths 71580,59492 -n 4 --pattern "0,2,1,0;1,3,2,3"
    # 47504 keys (long mix #2; the planner receives 61392, the bound says 38812)
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix


def least_max_kv(lengths: list[int], n: int, mask: str = "causal", tolerance: float = 1.01,
                 time_limit: float = 60.0) -> tuple[int | None, int | None]:
    """``(solver's lower bound, best plan found)`` on the most-loaded rank's received keys; equal
    when solved to optimality, ``best`` None where no plan was found (``lower`` None too where none
    balances)."""
    tokens = [(d, i) for d, length in enumerate(lengths) for i in range(length)]
    total = len(tokens)
    cost = [i + 1 if mask == "causal" else lengths[d] for d, i in tokens]
    cap = tolerance * sum(cost) / n
    x = lambda t, r: t * n + r  # noqa: E731
    y = lambda t, r: (total + t) * n + r  # noqa: E731
    z = 2 * total * n
    rows: list[tuple[dict[int, float], float, float]] = [({x(t, r): 1 for r in range(n)}, 1, 1) for t in range(total)]
    for r in range(n):
        rows.append(({x(t, r): 1 for t in range(total)}, total // n, -(-total // n)))
        rows.append(({x(t, r): cost[t] for t in range(total)}, -np.inf, cap))
        rows.append(({**{y(t, r): 1 for t in range(total)}, **{x(t, r): -1 for t in range(total)}, z: -1}, -np.inf, 0))
    start = 0
    for length in lengths:
        for t in range(start, start + length):
            for r in range(n):
                if mask == "causal":
                    rows.append(({y(t, r): 1, x(t, r): -1}, 0, np.inf))
                    if t + 1 < start + length:
                        rows.append(({y(t, r): 1, y(t + 1, r): -1}, 0, np.inf))
                else:
                    rows += [({y(t, r): 1, x(u, r): -1}, 0, np.inf) for u in range(start, start + length)]
        start += length
    matrix = lil_matrix((len(rows), z + 1))
    for k, (coefficients, _, _) in enumerate(rows):
        for variable, value in coefficients.items():
            matrix[k, variable] = value
    upper = np.ones(z + 1)
    upper[z] = total
    upper[[x(0, r) for r in range(1, n)]] = 0
    objective = np.zeros(z + 1)
    objective[z] = 1
    integral = np.zeros(z + 1)
    integral[: total * n] = 1
    result = milp(objective, integrality=integral, bounds=Bounds(np.zeros(z + 1), upper),
                  constraints=LinearConstraint(matrix.tocsr(), [lo for _, lo, _ in rows], [hi for _, _, hi in rows]),
                  options={"time_limit": time_limit})
    if result.status == 2:  # infeasible
        return None, None
    lower = math.ceil(result.mip_dual_bound - 1e-6)
    return lower, (round(result.fun) if result.x is not None else None)


def pattern_plan(lengths: list[int], n: int, pattern: list[list[int]], tolerance: float = 1.01,
                 starts: int = 200, seed: int = 0) -> tuple[float, list[list[tuple[int, float, float]]]] | None:
    """The least max KV found from ``starts`` random points for a causal plan whose document ``d`` is cut
    into ``len(pattern[d])`` runs, run ``i`` on rank ``pattern[d][i]``, with tokens per rank ``T / n`` and
    work within ``tolerance`` of the mean: ``(max KV, runs)``, each document's runs as ``(rank, start,
    end)``; None if no start converged."""
    from scipy.optimize import minimize

    total = sum(lengths)
    share = total / n
    work = lambda a, b: (b * (b + 1) - a * (a + 1)) / 2  # noqa: E731  (rows a..b-1 of a causal document)
    cap = tolerance * sum(work(0, length) for length in lengths) / n
    cuts = [len(ranks) - 1 for ranks in pattern]

    def runs(v: np.ndarray) -> list[list[tuple[int, float, float]]]:
        out, i = [], 0
        for length, ranks, k in zip(lengths, pattern, cuts, strict=True):
            edges = [0.0, *v[i:i + k], float(length)]
            out.append([(r, edges[j], edges[j + 1]) for j, r in enumerate(ranks)])
            i += k
        return out

    def per_rank(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens, load, kv = np.zeros(n), np.zeros(n), np.zeros(n)
        for doc in runs(v):
            for r in range(n):
                mine = [(a, b) for rank, a, b in doc if rank == r]
                if mine:  # a rank receives the keys below its highest row there that it lacks
                    kv[r] += max(b for _, b in mine) - sum(b - a for a, b in mine)
            for r, a, b in doc:
                tokens[r] += b - a
                load[r] += work(a, b)
        return tokens, load, kv

    def ordered(v: np.ndarray) -> np.ndarray:
        return np.concatenate([np.diff([0.0, *edges, float(length)]) for length, edges in
                               zip(lengths, np.split(v, np.cumsum(cuts)[:-1]), strict=True)])

    constraints = [{"type": "eq", "fun": lambda y: per_rank(y[:-1])[0][:-1] - share},
                   {"type": "ineq", "fun": lambda y: (cap - per_rank(y[:-1])[1]) / cap},
                   {"type": "ineq", "fun": lambda y: ordered(y[:-1])},
                   {"type": "ineq", "fun": lambda y: y[-1] - per_rank(y[:-1])[2]}]
    rng, best = np.random.default_rng(seed), None
    for _ in range(starts):
        v = np.concatenate([np.sort(rng.uniform(0, length, k)) for length, k in zip(lengths, cuts, strict=True)])
        result = minimize(lambda y: y[-1], np.append(v, per_rank(v)[2].max()), method="SLSQP",
                          constraints=constraints, options={"maxiter": 500})
        v = result.x[:-1]
        tokens, load, kv = per_rank(v)
        if (result.success and np.abs(tokens - share).max() < 1 and load.max() <= cap * (1 + 1e-6)
                and ordered(v).min() > -1e-6 and (best is None or kv.max() < best[0])):
            best = float(kv.max()), runs(v)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", required=True, help="comma-separated document lengths")
    parser.add_argument("-n", type=int, required=True, help="ranks")
    parser.add_argument("--mask", choices=("causal", "full"), default="causal")
    parser.add_argument("--tolerance", type=float, default=1.01, help="work max/mean a plan may reach")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for the solver")
    parser.add_argument("--pattern", help="the rank of each run of every document, in row order: "
                        "'0,2,1,0;1,3,2,3' (causal; solves the runs' boundaries, see the module docstring)")
    parser.add_argument("--starts", type=int, default=200, help="random starting points for --pattern")
    args = parser.parse_args()
    if args.pattern:
        lengths = [int(v) for v in args.lengths.split(",")]
        pattern = [[int(r) for r in doc.split(",")] for doc in args.pattern.split(";")]
        if len(pattern) != len(lengths) or any(not 0 <= r < args.n for doc in pattern for r in doc):
            parser.error("--pattern needs one comma-separated run of ranks in [0, n) per document, ';' between")
        found = pattern_plan(lengths, args.n, pattern, args.tolerance, args.starts)
        if found is None:
            print("no start converged to a plan with this pattern")
            return
        kv, runs = found
        print(f"{kv:.0f} keys ({kv / (sum(lengths) - sum(lengths) / args.n):.4f} of an all-gather)")
        for length, doc in zip(lengths, runs, strict=True):
            print(f"  document of {length}: " + ", ".join(f"rank {r} [{a:.0f}, {b:.0f})" for r, a, b in doc))
        return
    lower, best = least_max_kv([int(v) for v in args.lengths.split(",")], args.n, args.mask, args.tolerance,
                               args.time_limit)
    if lower is None:
        print("no plan balances")
    elif best is None:
        print(f"at least {lower} keys; no plan found within the time limit")
    elif lower == best:
        print(f"optimum: {best} keys")
    else:
        print(f"between {lower} and {best} keys (time limit)")


if __name__ == "__main__":
    main()
