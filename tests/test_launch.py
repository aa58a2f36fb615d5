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
