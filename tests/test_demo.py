"""The README's main job, for a few steps: it trains, reports, and its decoding check passes."""
import pytest

from conftest import DEVICES
from fast_causal_attn import demo


@pytest.mark.parametrize("device", DEVICES)
def test_demo_runs_and_decodes_consistently(capsys, device):
    assert demo.main(["--steps", "30", "--device", device]) == 0
    out = capsys.readouterr().out
    assert "trained 30 steps" in out and "recall" in out
    assert "step-by-step decoding with the state API gives the full forward's tokens: yes" in out


def test_recall_task_answers_are_the_queried_values():
    import torch

    task = demo.RecallTask(num_pairs=4)
    tokens = task.batch(32, torch.Generator().manual_seed(0), "cpu")
    assert tokens.shape == (32, task.length + 1)
    pairs = tokens[:, : 2 * task.num_pairs].view(32, task.num_pairs, 2)
    assert (tokens[:, -3] == task.query_token).all()
    for row in range(32):
        key, answer = tokens[row, -2], tokens[row, -1]
        match = pairs[row, :, 0] == key
        assert match.sum() == 1 and pairs[row, match, 1].item() == answer.item()
