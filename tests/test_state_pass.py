"""tcal/state_pass.py: fla's GDN state pass launched with a config chosen from rows x heads (inference).

The choice on any machine; on CUDA, bf16 against float64 no farther than fla's autotuned config, and in a
CUDA graph. fla's kernel at every value block the choice can give runs under Triton's CPU interpreter in
tests/test_split_state.py (the chunk forward it goes through)."""
from __future__ import annotations

import pytest
import torch

import tcal.state_pass as sp
from test_split_state import cuda_fla, errors_by_setting, gdn_inputs, replays_as_eager
from tcal.kernels import gated_delta_rule
from tcal.split_state import split_state_gated_delta_rule

CUDA = torch.device("cuda")  # only its type is read: the choice is made before any tensor goes there


def test_the_block_keeps_the_gpu_busy_within_the_measured_range(monkeypatch):
    monkeypatch.delenv(sp.SWITCH, raising=False)
    assert sp.state_pass_config(9, 64, 64, CUDA) == (16, 4, 3)    # batch 1 at SmolLM2's 9 heads: 36 programs
    assert sp.state_pass_config(18, 64, 64, CUDA) == (16, 4, 3)   # 72 programs at 16, 36 at 32
    assert sp.state_pass_config(36, 64, 64, CUDA) == (32, 4, 4)   # 72 programs
    assert sp.state_pass_config(72, 64, 64, CUDA) == (64, 4, 4)   # 72 programs
    assert sp.state_pass_config(73, 64, 64, CUDA) is None         # past what was measured: fla's own (training's)
    assert sp.state_pass_config(4, 128, 128, CUDA) is None        # a head size never timed
    assert sp.state_pass_config(9, 64, 64, torch.device("cpu")) is None
    monkeypatch.setenv(sp.SWITCH, "off")
    assert sp.state_pass_config(9, 64, 64, CUDA) is None


def test_one_piece_needs_a_launch_config():
    x = torch.zeros(1, 64, 1, 64)
    with pytest.raises(ValueError, match="launch config"):
        split_state_gated_delta_rule(x, x, x, x[..., 0], x[..., 0], 0.125, None, True, 1)


@cuda_fla
@pytest.mark.parametrize("batch,seq_len", [(1, 2048), (4, 1000), (8, 700)])
def test_as_close_to_float64_as_fla_tuned(monkeypatch, batch, seq_len):
    """Batch 1, 4 and 8 of 9 heads take blocks of 16, 32 and 64; the outputs are as near the float64
    recurrence as fla's autotuned config's, and a CUDA-graph replay gives the eager call's."""
    monkeypatch.setenv("SURGERY_STATE_SPLITS", "off")
    q, k, v, g, beta, state = inputs = gdn_inputs(batch, seq_len)
    assert sp.state_pass_config(batch * 9, 64, 64, q.device) is not None
    errors = errors_by_setting(monkeypatch, sp.SWITCH, ("off", "auto"), inputs)
    assert errors["auto"][0] <= 1.5 * errors["off"][0] + 1e-4, errors
    assert errors["auto"][1] <= 1.5 * errors["off"][1] + 1e-4, errors
    assert replays_as_eager(lambda: gated_delta_rule(q, k, v, g, beta, None, state, True, backend="fla"))
