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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", required=True, help="comma-separated document lengths")
    parser.add_argument("-n", type=int, required=True, help="ranks")
    parser.add_argument("--mask", choices=("causal", "full"), default="causal")
    parser.add_argument("--tolerance", type=float, default=1.01, help="work max/mean a plan may reach")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for the solver")
    args = parser.parse_args()
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
