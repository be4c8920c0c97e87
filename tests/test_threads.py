"""Threads on a CPU: accelerate launch leaves each process one thread unless told otherwise, and the script then
spreads the machine's cores over its processes; a thread count the user set (OMP_NUM_THREADS alone, or
--cpu_threads) is what the run uses."""

import os

import pytest
import torch

import gndpo_minimal as g


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize(
    "launcher, omp, cpu_threads, local, expected",
    [
        (True, "1", 0, "1", lambda: cores()),  # accelerate launch's default: every core for the one process
        (True, "1", 0, "2", lambda: max(1, cores() // 2)),  # two processes on the machine share its cores
        (False, "1", 0, "1", lambda: 1),  # the user's own OMP_NUM_THREADS is kept
        (True, "1", 1, "1", lambda: 1),  # --cpu_threads wins
    ],
    ids=["launched", "two_local_processes", "user_omp", "flag"],
)
def test_the_run_uses_the_cores_it_has(monkeypatch, restore_threads, launcher, omp, cpu_threads, local, expected):
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gave the process
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    if launcher:
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
    else:
        monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    g.make_accelerator(g.RunArgs(cpu_threads=cpu_threads))
    assert torch.get_num_threads() == expected()
