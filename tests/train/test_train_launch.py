"""The launcher: torchrun's environment, or local processes spawned on 127.0.0.1."""

from __future__ import annotations

import pytest
from _train_workers import all_reduce_rank, fail_on_rank_one

from pipetrain.errors import PipelineError
from pipetrain.train.launch import DistEnv, free_port, spawn, torchrun_env


def test_no_torchrun_environment_means_spawn() -> None:
    assert torchrun_env({}) is None
    assert torchrun_env({"RANK": "0", "WORLD_SIZE": "2"}) is None  # no rendezvous address


def test_torchrun_environment_is_read() -> None:
    env = torchrun_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    )
    assert env == DistEnv(rank=3, world_size=4, local_rank=1, init_method=None)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "malformed"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=2"),
    ],
)
def test_bad_torchrun_environment_is_a_clear_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(PipelineError, match=message):
        torchrun_env(environ)


def test_free_port_is_usable() -> None:
    assert 0 < free_port() < 65536


@pytest.mark.slow
def test_spawn_makes_a_working_gloo_group_one_thread_each(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spawn(all_reduce_rank, 2, str(tmp_path))
    for rank in range(2):
        world, threads, total = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert (world, threads, float(total)) == ("2", "1", 3.0)


@pytest.mark.slow
def test_spawn_reports_the_failing_rank() -> None:
    with pytest.raises(PipelineError, match="rank 1 failed: ValueError: bad data on purpose"):
        spawn(fail_on_rank_one, 2)


def test_spawn_needs_a_rank() -> None:
    with pytest.raises(PipelineError, match="at least one rank"):
        spawn(fail_on_rank_one, 0)
