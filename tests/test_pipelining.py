"""torch's own pipelining over a gang: ``PipelineStage(..., group=gangs.pp.as_process_group())``.

GPipe and 1F1B, pp 2 (with dp 4) and pp 4 (with dp 2) on 8 real processes (one shared world): per
step, the losses and every stage's gradients (averaged over ``gangs.dp``) equal the unsplit float64
model's on the whole batch.
"""

from __future__ import annotations

import pipelining_workers as pw
import pytest
import torch

from gang.testing import World


@pytest.mark.parametrize("schedule", sorted(pw.SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_schedule_equals_unsplit_model(world8: World, pp: int, schedule: str) -> None:
    results = world8.run(pw.pipelined, pp, schedule)
    stages = sorted({result["stage"] for result in results})
    assert stages == list(range(pp))
    for rank, result in enumerate(results):
        assert result["dp_size"] == 8 // pp
        last = result["stage"] == pp - 1
        for step in range(pw.STEPS):
            loss = result["losses"][step]
            if last:
                assert loss == pytest.approx(result["reference_losses"][step], rel=1e-12), f"rank {rank}, step {step}"
            else:
                assert loss is None
            ours, reference = result["grads"][step], result["reference_grads"][step]
            assert sorted(ours) == sorted(reference)
            for name in reference:
                torch.testing.assert_close(ours[name], reference[name], rtol=1e-12, atol=1e-14)
