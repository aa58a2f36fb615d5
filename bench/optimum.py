"""The least KV any plan of a small layout makes its most-loaded rank receive, by integer programming.

The lower bound (``doccp.plan.bound``) claims that no plan with tokens per rank within one and work
max/mean <= the tolerance receives less than it says. Exhaustive search checks that claim on layouts of
about ten tokens (``tests/test_plan.py``); this script checks it on layouts of a hundred, where several
documents compete for the same cheap fill, with a mixed-integer program solved by HiGHS through SciPy
(``scipy.optimize.milp``; SciPy comes with doccp's ``bench`` and ``dev`` extras, not with doccp).

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

``--block B`` bounds layouts of any size from below: the program over blocks of at most ``B`` rows,
relaxed so that every balanced plan has a solution of it with no more KV (:func:`block_lower_bound`).
Where a few long documents decide the KV it is far tighter than ``doccp.plan.bound``::

    python bench/optimum.py --lengths 1375,401,67469,1167,60660 -n 3 --block 4096
    # at least 36324 keys (long mix #6; doccp.plan.bound says 24357, the planner receives 38439)

Without ``--lengths`` it prints the benchmark section (``doccp bench --only optimum``): the planner's
max KV on the plan benchmark's layouts of few long documents against both bounds.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix, csr_matrix


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
    upper = np.ones(z + 1)
    upper[z] = total
    upper[[x(0, r) for r in range(1, n)]] = 0
    integral = np.zeros(z + 1)
    integral[: total * n] = 1
    result = _minimise_last(rows, upper, integral, time_limit)
    if result.status == 2:  # infeasible
        return None, None
    lower = math.ceil(result.mip_dual_bound - 1e-6)
    return lower, (round(result.fun) if result.x is not None else None)


def block_lower_bound(lengths: list[int], n: int, block: int, mask: str = "causal", tolerance: float = 1.01,
                      time_limit: float = 60.0) -> tuple[int | None, bool]:
    """A lower bound on the least max KV of any balanced plan, for layouts of any size: the program of
    :func:`least_max_kv` over *blocks* of at most ``block`` rows of a document instead of single tokens,
    relaxed so that every plan has a solution of it with no more KV. ``(bound, solved)``: ``solved`` when
    the solver proved its optimum, to its 0.01% gap (else the bound is its dual bound at the time limit,
    still a bound); the bound None where not even the relaxation balances.

    Per (block, rank): ``x`` rows of the block (continuous), ``z`` (binary) whether any, ``y`` whether the
    rank needs every key of the block (causal: it holds a row of a later block of the document; full: any
    row of the document), ``u = min(x, block * y)`` the rows of such blocks it holds, and ``w`` its work,
    at least that of the block's ``x`` cheapest rows (tangents of that convex function; exact for the
    full mask). A rank receives at least ``sum(block * y - u)``: the keys of the blocks below its top
    block that it lacks (the keys it lacks inside its top block are left out: the relaxation). Ranks are
    interchangeable, so the holder of the ``k``-th longest document's last row is one of ranks ``0..k``.
    The loss is at most a block of keys per (rank, document), so the bound is near the optimum where a
    few long documents decide it, and says little where the packing of many short ones does (a short
    document is one block, free to share out)."""
    blocks = []  # (doc, first row, end row)
    for d, length in enumerate(lengths):
        k = -(-length // block)  # (none for an empty document)
        edges = [round(i * length / k) for i in range(k + 1)] if k else []
        blocks += [(d, edges[i], edges[i + 1]) for i in range(k)]
    nb, per = len(blocks), 5  # x, z, y, u, w per (block, rank); then the max KV
    var = lambda kind, b, r: (b * n + r) * per + kind  # noqa: E731
    x_, z_, y_, u_, w_ = range(per)
    most = nb * n * per
    rows: list[tuple[dict[int, float], float, float]] = []
    full = mask == "full"
    tangents = 1 if full else 8
    total = sum(lengths)
    cost = sum(length * length if full else length * (length + 1) / 2 for length in lengths)
    # Work in units of a rank's cap, rows and keys in units of a block: the solver's tolerances are
    # absolute, and with work in pairs (1e9 and more) it proved optima that plans beat.
    cap, unit = tolerance * cost / n, max(block, 1)
    for b, (d, a, e) in enumerate(blocks):
        size = (e - a) / unit
        rows.append(({var(x_, b, r): 1 for r in range(n)}, size, size))
        later = b + 1 < nb and blocks[b + 1][0] == d
        for r in range(n):
            rows.append(({var(x_, b, r): 1, var(z_, b, r): -size}, -np.inf, 0))
            rows.append(({var(u_, b, r): 1, var(x_, b, r): -1}, -np.inf, 0))
            rows.append(({var(u_, b, r): 1, var(y_, b, r): -size}, -np.inf, 0))
            if full:  # one y per document: needed whole by any holder of a row
                rows.append(({var(y_, b, r): 1, var(z_, b, r): -1}, 0, np.inf))
                if later:
                    rows.append(({var(y_, b, r): 1, var(y_, b + 1, r): -1}, 0, 0))
            elif later:  # needed whole by a holder of a later row
                rows.append(({var(y_, b, r): 1, var(y_, b + 1, r): -1}, 0, np.inf))
                rows.append(({var(y_, b, r): 1, var(z_, b + 1, r): -1}, 0, np.inf))
            for t in range(tangents + 1):  # w >= the cheapest rows' work, at tangent points x0
                x0 = (e - a) * t / tangents
                if full:
                    work, slope = lengths[d] * x0, lengths[d]
                else:  # rows a, a + 1, ... cost a + 1, a + 2, ...
                    work, slope = x0 * (a + 1) + x0 * (x0 - 1) / 2, a + 0.5 + x0
                rows.append(({var(w_, b, r): 1, var(x_, b, r): -slope * unit / cap}, (work - slope * x0) / cap,
                             np.inf))
    for r in range(n):
        rows.append(({var(x_, b, r): 1 for b in range(nb)}, (total // n) / unit, -(-total // n) / unit))
        rows.append(({var(w_, b, r): 1 for b in range(nb)}, -np.inf, 1))
        kv = {var(y_, b, r): (e - a) / unit for b, (_, a, e) in enumerate(blocks)}
        rows.append(({**kv, **{var(u_, b, r): -1 for b in range(nb)}, most: -1}, -np.inf, 0))
    longest = sorted((d for d, length in enumerate(lengths) if length), key=lambda d: -lengths[d])[: n - 1]
    for k, d in enumerate(longest):
        last = max(b for b, (doc, _, _) in enumerate(blocks) if doc == d)
        rows.append(({var(z_, last, r): 1 for r in range(k + 1)}, 1, np.inf))
    upper = np.full(most + 1, np.inf)
    integral = np.zeros(most + 1)
    for b, (_, a, e) in enumerate(blocks):
        for r in range(n):
            upper[var(x_, b, r)], upper[[var(z_, b, r), var(y_, b, r)]] = (e - a) / unit, 1
            integral[var(z_, b, r)] = 1
    result = _minimise_last(rows, upper, integral, time_limit)
    if result.status == 2:  # infeasible
        return None, True
    if result.status not in (0, 1) or result.mip_dual_bound is None:
        raise RuntimeError(f"the solver stopped without a bound: {result.message}")
    dual = float(result.mip_dual_bound) * unit
    return max(math.ceil(dual - 1e-6 * max(1.0, abs(dual))), 0), result.status == 0


def _minimise_last(rows: list[tuple[dict[int, float], float, float]], upper: np.ndarray, integral: np.ndarray,
                   time_limit: float):
    """HiGHS's least last variable subject to ``rows`` (``(coefficients by variable, low, high)``), the
    variables in ``[0, upper]``, the ``integral`` ones integers."""
    columns = upper.size
    objective = np.zeros(columns)
    objective[-1] = 1
    return milp(objective, integrality=integral, bounds=Bounds(np.zeros(columns), upper),
                constraints=LinearConstraint(_matrix(rows, columns), [lo for _, lo, _ in rows],
                                             [hi for _, _, hi in rows]),
                options={"time_limit": time_limit})


def _matrix(rows: list[tuple[dict[int, float], float, float]], columns: int) -> csr_matrix:
    """The constraint matrix of ``rows`` (coefficients by variable)."""
    at = [(k, v, c) for k, (coefficients, _, _) in enumerate(rows) for v, c in coefficients.items()]
    k, v, c = zip(*at, strict=True)
    return coo_matrix((c, (k, v)), shape=(len(rows), columns)).tocsr()


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


#: The bench section's layouts: (mix, ranks), with the layouts of 131072 tokens of ``bench/plan.py``.
SECTION = (("long", 2), ("long", 3), ("long", 4))
#: Blocks per rank's tokens of the section's relaxation (finer: a tighter bound, a slower solve).
BLOCKS_PER_RANK = 8
#: Seconds the solver has per layout in the section (its dual bound at the limit is still a bound).
SECTION_TIME_LIMIT = 60.0


def section(quick: bool = False) -> str:
    """The benchmark section: on the planner's own layouts where few long documents decide the KV,
    the balanced planner's max KV against ``doccp.plan.bound`` and against the block relaxation's
    bound (:func:`block_lower_bound`), which is far tighter there."""
    import importlib
    import time

    import torch

    from doccp import DocLayout, Mask, plan
    from doccp.app import workloads

    kv_lower_bound = importlib.import_module("doccp.plan.bound").kv_lower_bound
    torch.set_num_threads(1)
    tokens, count = 131072, 2 if quick else 8
    limit = 10.0 if quick else SECTION_TIME_LIMIT
    lines = ["## How far from the optimum the planner is", "",
             f"Reproduce: `python bench/optimum.py{' --quick' if quick else ''}` (SciPy's HiGHS; the layouts of "
             f"`bench/plan.py`, {tokens} tokens, causal mask). Bound = `doccp.plan.bound.kv_lower_bound`; block "
             f"bound = `block_lower_bound` in `bench/optimum.py`: the integer program of the least max KV over "
             f"blocks of at most T / ({BLOCKS_PER_RANK} N) rows, relaxed so that it holds for every plan with "
             f"tokens within one and imbalance <= 1.01, its solver's dual bound after at most {limit:.0f} s "
             "(*solved*: proven optimal for the relaxation). *ratio* = the balanced planner's max KV over the "
             "larger bound. One thread.", "",
             "| mix | N | layout | documents | max KV balanced | bound | block bound | solved | solve s "
             "| ratio to bound | ratio to the larger |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mix, n in SECTION:
        for i, lengths in enumerate(workloads.layouts(mix, tokens, count)):
            layout = DocLayout.from_lengths(lengths)
            stats = plan(layout, n, Mask.causal()).stats()
            kv = max(stats.kv_recv)
            analytic = kv_lower_bound(layout, n, Mask.causal())
            start = time.perf_counter()
            block, solved = block_lower_bound([int(v) for v in lengths], n, max(tokens // (BLOCKS_PER_RANK * n), 1),
                                              time_limit=limit)
            seconds = time.perf_counter() - start
            if stats.imbalance <= 1.01 and (block is None or block > kv):  # (a solver's numerical failure)
                raise RuntimeError(f"{mix} #{i} over {n} ranks: the block relaxation claims {block} keys, but the "
                                   f"planner's balanced plan receives {kv}")
            best = max(analytic, block or 0)
            lines.append(f"| {mix} | {n} | {i} | {len(lengths)} | {kv} | {analytic} | {block} | "
                         f"{'yes' if solved else 'no'} | {seconds:.0f} | {kv / max(analytic, 1):.2f} | "
                         f"{kv / max(best, 1):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", help="comma-separated document lengths (without: the benchmark section)")
    parser.add_argument("-n", type=int, help="ranks")
    parser.add_argument("--mask", choices=("causal", "full"), default="causal")
    parser.add_argument("--tolerance", type=float, default=1.01, help="work max/mean a plan may reach")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for the solver")
    parser.add_argument("--block", type=int, help="rows per block: a lower bound by the block relaxation "
                        "(any size of layout; see block_lower_bound)")
    parser.add_argument("--pattern", help="the rank of each run of every document, in row order: "
                        "'0,2,1,0;1,3,2,3' (causal; solves the runs' boundaries, see the module docstring)")
    parser.add_argument("--starts", type=int, default=200, help="random starting points for --pattern")
    parser.add_argument("--quick", action="store_true", help="the section on 2 layouts, 10 s per solve")
    args = parser.parse_args(argv)
    if args.lengths is None:
        print(section(args.quick))
        return
    if args.n is None:
        parser.error("-n is required with --lengths")
    lengths = [int(v) for v in args.lengths.split(",")]
    if args.block is not None:
        if args.block < 1:
            parser.error(f"--block must be at least 1, got {args.block}")
        lower, solved = block_lower_bound(lengths, args.n, args.block, args.mask, args.tolerance, args.time_limit)
        if lower is None:
            print("no plan balances")
        else:
            print(f"at least {lower} keys (blocks of {args.block}; "
                  f"{'solved' if solved else 'the dual bound at the time limit'})")
        return
    if args.pattern:
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
    lower, best = least_max_kv(lengths, args.n, args.mask, args.tolerance, args.time_limit)
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
