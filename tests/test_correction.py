"""Train–inference mismatch corrections against closed forms worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from verst.train.correction import ess_ratio, mis_weights, tis_weights, train_rollout_kl

LN2 = math.log(2.0)


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


def approx(metrics: dict[str, float], expected: dict[str, float]) -> None:
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key


# ---------------------------------------------------------------- TIS


def test_tis_clamps_and_reports() -> None:
    # raw ratios [0.5, 1, 3, (1.5 masked)], clamp to [0.6, 2] -> [0.6, 1, 2, 0]
    # tis_mean = (0.5 + 1 + 3) / 3 = 1.5; tis_abs = (0.5 + 0 + 2) / 3 = 0.833333;
    # clipfrac: 0.5 and 3 are outside -> 2/3
    train_B_T = torch.log(torch.tensor([[0.5, 1.0, 3.0, 1.5]])).requires_grad_(True)
    rollout_B_T = torch.zeros(1, 4)
    mask_B_T = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights_B_T, metrics = tis_weights(train_B_T, rollout_B_T, mask_B_T, low=0.6, high=2.0)
    close(weights_B_T, [[0.6, 1.0, 2.0, 0.0]])
    assert not weights_B_T.requires_grad
    approx(metrics, {"tis_mean": 1.5, "tis_abs": 2.5 / 3, "tis_clipfrac": 2 / 3})
    # token_normaliser turns the means into this micro-batch's share of a 6-token batch
    _, metrics = tis_weights(
        train_B_T, rollout_B_T, mask_B_T, low=0.6, high=2.0, token_normaliser=6.0
    )
    approx(metrics, {"tis_mean": 0.75, "tis_abs": 2.5 / 6, "tis_clipfrac": 1 / 3})


# ---------------------------------------------------------------- MIS

# log-ratios: row 0 [ln2, ln2, (masked 5)] -> token [2, 2], sequence e^(2 ln2) = 4, geometric 2
#             row 1 [ln2, -ln2, 0]         -> token [2, 0.5, 1], sequence 1, geometric 1
MIS_TRAIN_B_T = torch.tensor([[LN2, LN2, 5.0], [LN2, -LN2, 0.0]])
MIS_ROLLOUT_B_T = torch.zeros(2, 3)
MIS_MASK_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    ("level", "mode", "high", "weights", "metrics"),
    [
        # raw [2, 2 | 2, 0.5, 1]: mean 7.5/5, abs (1 + 1 + 1 + 0.5 + 0)/5; 0.5 < 0.6 is outside
        ("token", "truncate", 3.0, [[2, 2, 0], [2, 0.6, 1]], (1.5, 0.7, 0.2, 0.0)),
        ("token", "mask", 3.0, [[2, 2, 0], [2, 0, 1]], (1.5, 0.7, 0.2, 0.2)),
        # raw [4, 4 | 1, 1, 1]: mean 11/5, abs (3 + 3)/5; row 0 (2 tokens) is outside
        ("sequence", "truncate", 3.0, [[3, 3, 0], [1, 1, 1]], (2.2, 1.2, 0.4, 0.0)),
        ("sequence", "mask", 3.0, [[0, 0, 0], [1, 1, 1]], (2.2, 1.2, 0.4, 0.4)),
        # raw [2, 2 | 1, 1, 1]: mean 7/5, abs (1 + 1)/5; nothing outside [0.6, 3]
        ("geometric", "truncate", 3.0, [[2, 2, 0], [1, 1, 1]], (1.4, 0.4, 0.0, 0.0)),
        ("geometric", "mask", 3.0, [[2, 2, 0], [1, 1, 1]], (1.4, 0.4, 0.0, 0.0)),
        # with high 1.5, row 0's geometric ratio 2 is outside
        ("geometric", "truncate", 1.5, [[1.5, 1.5, 0], [1, 1, 1]], (1.4, 0.4, 0.4, 0.0)),
        ("geometric", "mask", 1.5, [[0, 0, 0], [1, 1, 1]], (1.4, 0.4, 0.4, 0.4)),
    ],
)
def test_mis_levels_and_modes(
    level: str, mode: str, high: float, weights: list, metrics: tuple
) -> None:
    weights_B_T, out = mis_weights(
        MIS_TRAIN_B_T, MIS_ROLLOUT_B_T, MIS_MASK_B_T, level=level, mode=mode, low=0.6, high=high
    )
    close(weights_B_T, weights)
    keys = ("mis_mean", "mis_abs", "mis_clipfrac", "mis_masked_frac")
    approx(out, dict(zip(keys, metrics, strict=True)))


# ---------------------------------------------------------------- ESS and KL


def test_ess_ratio() -> None:
    assert ess_ratio(torch.full((2, 3), 0.7), torch.ones(2, 3)) == pytest.approx(1.0)
    # [1, 0]: (1)^2 / (2 * 1) = 0.5; the masked 99 is ignored
    assert ess_ratio(torch.tensor([[1.0, 0.0, 99.0]]), torch.tensor([[1.0, 1.0, 0.0]])) == 0.5
    assert ess_ratio(torch.ones(2, 2), torch.zeros(2, 2)) == 1.0
    assert ess_ratio(torch.zeros(2, 2), torch.ones(2, 2)) == 0.0


def test_train_rollout_kl_is_k3() -> None:
    # train - rollout = ln2: 2 - 1 - ln2 = 0.3068528; = -ln2: 0.5 - 1 + ln2 = 0.1931472; 0 -> 0
    # mean over 3 masked-in tokens: 0.5 / 3
    train_B_T = torch.tensor([[LN2, -LN2, 0.0, 7.0]])
    mask_B_T = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert train_rollout_kl(train_B_T, torch.zeros(1, 4), mask_B_T) == pytest.approx(0.5 / 3)


def test_empty_and_inf_padding_give_no_nan() -> None:
    train_B_T = torch.tensor([[-math.inf, -1.0]])
    rollout_B_T = torch.tensor([[-1.0, -math.inf]])
    empty_B_T = torch.zeros(1, 2)
    weights_B_T, metrics = tis_weights(train_B_T, rollout_B_T, empty_B_T, low=0.0, high=2.0)
    close(weights_B_T, [[0.0, 0.0]])
    assert all(v == 0.0 for v in metrics.values())
    for level in ("token", "sequence", "geometric"):
        weights_B_T, metrics = mis_weights(
            train_B_T, rollout_B_T, empty_B_T, level=level, mode="mask", low=0.5, high=2.0
        )
        close(weights_B_T, [[0.0, 0.0]])
        assert all(v == 0.0 for v in metrics.values())
    assert train_rollout_kl(train_B_T, rollout_B_T, empty_B_T) == 0.0
