"""surgery/decode/weight_watch.py: one look a call sees an in-place edit, a move or cast, and nothing else."""
from __future__ import annotations

import torch

from surgery.decode.weight_watch import WeightWatch


def test_sees_edits_moves_and_casts():
    layer = torch.nn.Linear(4, 4)
    watch = WeightWatch(layer.parameters)
    assert watch.changed()  # the first look
    assert not watch.changed() and not watch.changed()
    with torch.no_grad():
        layer.weight.mul_(2)  # an optimizer's in-place step
    assert watch.changed() and not watch.changed()
    layer.bias.data = torch.zeros(4)  # a new storage
    assert watch.changed() and not watch.changed()
    layer.double()  # a cast: new storages, same Parameter objects
    assert watch.changed() and not watch.changed()
    layer(torch.randn(2, 4, dtype=torch.float64))  # a forward reads, never edits
    assert not watch.changed()
