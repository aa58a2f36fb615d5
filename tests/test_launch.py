"""The process launcher used by tests, the demo and benchmarks."""

import os

import pytest
import torch

from doccp.launch import WorkerError, spawn


def exit_on_rank_1(rank: int) -> int:
    if rank == 1:
        os._exit(3)  # dies without reporting, as a killed or crashed rank would
    torch.distributed.barrier()
    return rank


def tensors(rank: int) -> dict:
    return {"rank": rank, "x": torch.full((3,), float(rank))}


def test_dead_rank_is_reported_not_waited_for():
    with pytest.raises(WorkerError, match="rank 1 died without reporting: exit code 3"):
        spawn(exit_on_rank_1, 2, timeout_s=20)


def test_results_come_back_by_value_in_rank_order():
    results = spawn(tensors, 2)
    assert [r["rank"] for r in results] == [0, 1]
    assert torch.equal(results[1]["x"], torch.ones(3))


def environment_and_threads(rank: int) -> tuple[str | None, int, bool]:
    return os.environ.get("DOCCP_TEST_MARK"), torch.get_num_threads(), torch.cuda.is_initialized()


def test_workers_take_the_callers_environment_at_each_call(monkeypatch):
    spawn(tensors, 2)  # the worker server is running before the variable exists
    monkeypatch.setenv("DOCCP_TEST_MARK", "first")
    assert [r[0] for r in spawn(environment_and_threads, 2)] == ["first", "first"]
    monkeypatch.setenv("DOCCP_TEST_MARK", "second")
    results = spawn(environment_and_threads, 3, threads=1)
    assert [r[0] for r in results] == ["second"] * 3
    assert all(threads == 1 and not cuda for _, threads, cuda in results)
    monkeypatch.delenv("DOCCP_TEST_MARK")
    assert [r[0] for r in spawn(environment_and_threads, 2)] == [None, None]


def test_workers_start_from_a_preloaded_server_where_the_platform_has_one():
    import multiprocessing

    from doccp.launch import PRELOAD, context

    ctx = context()
    if "forkserver" in multiprocessing.get_all_start_methods():
        assert ctx.get_start_method() == "forkserver" and "torch" in PRELOAD and "doccp" in PRELOAD
    else:
        assert ctx.get_start_method() == "spawn"
