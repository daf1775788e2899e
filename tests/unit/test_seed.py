"""`seed_all`: msprobe's helper with msprobe's meaning (the first line of msprobe's usage imports it)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from trainermon import seed_all


@pytest.fixture
def restore_determinism(monkeypatch):
    import torch.nn.functional as F

    for key in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC"):
        monkeypatch.delenv(key, raising=False)
    names = (
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "scaled_dot_product_attention",
    )
    saved = {n: getattr(F, n) for n in names}
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark = before[1]
    torch.backends.cudnn.deterministic = False
    for name, fn in saved.items():
        setattr(F, name, fn)


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_the_same_seed_gives_the_same_draws(restore_determinism):
    seed_all(7)
    first = _draws()
    seed_all(7)
    assert _draws() == first
    seed_all(8)
    assert _draws() != first
    assert os.environ["PYTHONHASHSEED"] == "8"
    assert not torch.are_deterministic_algorithms_enabled()


def test_mode_turns_on_deterministic_algorithms(restore_determinism):
    seed_all(1234, mode=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["HCCL_DETERMINISTIC"] == "true"


def test_rm_dropout_keeps_every_value(restore_determinism):
    x = torch.ones(1000)
    assert (torch.nn.Dropout(0.5).train()(x) == 0).any()
    seed_all(1, rm_dropout=True)
    seed_all(1, rm_dropout=True)  # twice: still one wrapper
    assert torch.equal(torch.nn.Dropout(0.5).train()(x), x)
    assert torch.equal(
        torch.nn.functional.dropout2d(torch.ones(2, 3, 4, 5), 0.9, True), torch.ones(2, 3, 4, 5)
    )
    q = torch.randn(1, 2, 6, 4)  # attention's own dropout: positional and keyword dropout_p
    plain = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    for call in (
        lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, None, 0.9),
        lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.9),
    ):
        assert torch.allclose(call(), plain)
    mha = torch.nn.MultiheadAttention(4, 2, dropout=0.9, batch_first=True).train()
    x = torch.randn(1, 6, 4)
    assert torch.equal(mha(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**32}, "seed="),
        ({"seed": 1.5}, "seed=1.5"),
        ({"seed": True}, "seed=True"),
        ({"mode": 1}, "mode=1"),
        ({"rm_dropout": "yes"}, "rm_dropout='yes'"),
    ],
)
def test_bad_arguments_name_the_argument_and_what_is_allowed(kwargs, named):
    with pytest.raises(ValueError, match="allowed") as info:
        seed_all(**kwargs)
    assert named in str(info.value)
