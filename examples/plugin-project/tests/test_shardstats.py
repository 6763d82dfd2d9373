"""shardstats on real gangs: each test body runs on every rank of a local gloo gang (gang's pytest plugin)."""

from __future__ import annotations

import pytest
import torch
from shardstats import global_mean, global_min_max, histogram, shard

from gang import FakeGang, Gang, all_gather_objects


@pytest.fixture
def data() -> list[float]:
    """The whole data set; each rank takes its shard of it."""
    return [float(x * x % 17) for x in range(101)]


@pytest.mark.gang(world_size=[2, 4])
def test_shards_cover_the_data_once(gang: Gang, data: list[float]) -> None:
    parts = all_gather_objects(gang, shard(gang, data))
    assert [x for part in parts for x in part] == data
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.gang(world_size=[2, 4])
def test_global_statistics_match_the_whole_data(gang: Gang, data: list[float]) -> None:
    mine = torch.tensor(shard(gang, data))
    whole = torch.tensor(data)
    assert global_mean(gang, mine) == pytest.approx(float(whole.mean()))
    assert global_min_max(gang, mine) == (float(whole.min()), float(whole.max()))


@pytest.mark.gang(world_size=4)
@pytest.mark.parametrize("bins", [1, 5, 17])
def test_histogram_matches_the_whole_data(gang: Gang, data: list[float], bins: int) -> None:
    mine = torch.tensor(shard(gang, data))
    expected = torch.histc(torch.tensor(data, dtype=torch.float64), bins=bins, min=0, max=16).to(torch.int64)
    assert torch.equal(histogram(gang, mine, bins, 0.0, 16.0), expected)


@pytest.mark.gang(world_size=3, timeout=30)
def test_empty_ranks_are_fine_but_all_empty_is_an_error(gang: Gang) -> None:
    mine = torch.tensor([2.0, 4.0]) if gang.rank == 1 else torch.tensor([])
    assert global_mean(gang, mine) == 3.0
    with pytest.raises(ValueError, match="`values` must hold at least one value"):
        global_mean(gang, torch.tensor([]))


def test_single_process_code_path_on_a_fake_gang(data: list[float]) -> None:
    # No marker: an ordinary test, in the pytest process.
    gang = FakeGang(torch.device("cpu"))
    assert shard(gang, data) == data
    assert global_mean(gang, torch.tensor(data)) == pytest.approx(sum(data) / len(data))
