"""SavedActivationMeter counts the storages autograd keeps for backward, once each, until freed."""

from __future__ import annotations

import torch

from dynabatch.engine.memory import SavedActivationMeter


def test_counts_saved_storages_once_and_releases_them_after_backward():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    with SavedActivationMeter(exclude=lin.parameters()) as meter:
        h = lin(x)  # saves x (its weight is excluded)
        y = (torch.relu(h) * torch.relu(h)).sum()  # relu saves its output; the product saves both operands
        assert meter.live_bytes == x.numel() * 4 * 3  # x, relu(h) twice: two distinct relu outputs
        y.backward()
        assert meter.live_bytes == 0
    assert meter.peak_bytes == x.numel() * 4 * 3


def test_views_of_one_storage_count_once():
    x = torch.randn(128, 64, requires_grad=True)
    with SavedActivationMeter() as meter:
        a = x * 2
        (a[:64] * a[64:]).sum().backward()  # saves two views of a's storage
    assert meter.peak_bytes == a.numel() * 4
