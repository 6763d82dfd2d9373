"""The examples of the "Pipelines and experts" guide, on real processes (one shared world of 4).

- ``examples/pipeline_send_recv.py``: a 1F1B pipeline written with ``send_recv`` alone trains with
  losses and gradients equal to the unsplit float64 model, over 4 stages and over two pipelines of
  2 stages, on ProcessGroupGang and on JaxGang.
- ``examples/moe_experts.py``: a top-2 mixture-of-experts layer over ``gangs.ep`` built on
  ``exchange_rows`` equals its dense single-process reference in outputs and every gradient, with
  uneven token counts, a rank with no tokens, and a rank whose experts receive no rows.
"""

from __future__ import annotations

import pytest
import traffic_examples_workers as tw

from gang.testing import World


@pytest.mark.parametrize(
    ("kind", "pp_size"),
    [
        ("torch", 4),
        ("torch", 2),
        ("jax", 4),
    ],
)
def test_send_recv_pipeline_equals_unsplit_model(world4: World, kind: str, pp_size: int) -> None:
    for rank, problems in enumerate(world4.run(tw.pipeline, kind, pp_size)):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.parametrize("ep_size", [4, 2])
def test_moe_layer_equals_dense_reference(world4: World, ep_size: int) -> None:
    results = world4.run(tw.moe, ep_size)
    for rank, result in enumerate(results):
        for case, problems in result["problems"].items():
            assert problems == [], f"rank {rank}, {case}: {problems}"
    ep_ranks = [result["ep_rank"] for result in results]
    assert ep_ranks == [rank % ep_size for rank in range(4)]
    tokens = [result["tokens"] for result in results[:ep_size]]
    assert 0 in tokens and len(set(tokens)) == ep_size, tokens  # uneven, and one rank has none
    every, starved = tw.MOE_CASES
    # Every rank's experts got rows in the first case; the last rank's got none in the second.
    assert all(result["received"][every] > 0 for result in results)
    assert [result["received"][starved] == 0 for result in results[:ep_size]] == [False] * (ep_size - 1) + [True]
