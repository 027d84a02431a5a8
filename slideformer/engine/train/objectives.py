"""Preference objectives as functions of per-sequence log-probabilities.

For a step of P pairs, let ``S_c``, ``S_r`` be the policy's summed log-probabilities of the
chosen and rejected responses, ``n_c``, ``n_r`` their token counts, ``R_c``, ``R_r`` the
reference's, ``b`` = preference.beta. Each loss is the mean over the step's pairs:

- DPO (Rafailov et al. 2023), with the margin ``m = (S_c - R_c) - (S_r - R_r)``:
  sigmoid ``-log sigmoid(b m)``; hinge (SLiC) ``max(0, 1 - b m)``; ipo (Azar et al. 2023)
  ``(m - 1 / (2 b))^2``. Implicit rewards ``b (S - R)``.
- SimPO (Meng et al. 2024): ``-log sigmoid(b (S_c / n_c - S_r / n_r) - gamma)``; rewards
  ``b S / n``.
- KTO (Ethayarajh et al. 2024), on single replies labelled desirable or not, rows paired
  with a mismatched completion of the same prompt (the ``rejected`` slot, for the KL term):
  ``r = S - R``, ``z0 = max(0, mean(S_kl - R_kl))`` held constant (no gradient), a desirable
  reply's loss ``lambda_D (1 - sigmoid(b (r - z0)))``, an undesirable one's ``lambda_U (1 -
  sigmoid(b (z0 - r)))``, the mean over the step's replies (TRL's KTOTrainer); rewards ``b r``.
- ORPO (Hong et al. 2024): the chosen responses' NLL per token over the step, ``-sum S_c /
  sum n_c``, plus ``b`` (the paper's lambda) times the mean of ``-log sigmoid(log odds(p_c) -
  log odds(p_r))``, where ``log p = S / n`` (the mean token log-probability) and
  ``log odds(p) = log p - log(1 - p)``; rewards ``b log p``.

The engine needs only ``dL/dS`` per sequence: every response token's log-probability enters
``S`` with weight one, so the gradient of the loss w.r.t. a token's cross-entropy is
``-dL/dS`` of its sequence, and one weighted cross-entropy backward over the head gives the
exact gradient (runtime.ends). :func:`pair_loss` is that function; autograd gives ``dL/dS``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slideformer.engine.config import PreferenceConfig

NEEDS_REFERENCE = {"dpo": True, "orpo": False, "simpo": False, "kto": True}


@dataclass(frozen=True)
class PairStats:
    """What a step's pairs say about the preference (the Train page's rewards chart)."""
    accuracy: float
    """Share of pairs whose chosen reward is above the rejected one."""
    chosen: float
    """Mean implicit reward of the chosen responses."""
    rejected: float
    margin: float
    """Mean chosen minus rejected reward."""


def pair_loss(kind: str, cfg: PreferenceConfig, s_c: torch.Tensor, s_r: torch.Tensor,
              n_c: torch.Tensor, n_r: torch.Tensor, ref_c: torch.Tensor | None,
              ref_r: torch.Tensor | None, desirable: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen rewards, rejected rewards) of a step's pairs, each (P,) but the loss (KTO:
    the rewards of the desirable replies and of the undesirable ones, ``desirable`` (P,) bool
    saying which)."""
    b = cfg.beta
    if kind == "kto":
        r = s_c - ref_c
        z0 = (s_r - ref_r).mean().clamp(min=0).detach()
        losses = torch.where(desirable, cfg.desirable_weight * (1 - torch.sigmoid(b * (r - z0))),
                             cfg.undesirable_weight * (1 - torch.sigmoid(b * (z0 - r))))
        return losses.mean(), b * r[desirable], b * r[~desirable]
    if kind == "dpo":
        rc, rr = s_c - ref_c, s_r - ref_r
        m = rc - rr
        losses = {"sigmoid": lambda: -F.logsigmoid(b * m),
                  "hinge": lambda: torch.relu(1 - b * m),
                  "ipo": lambda: (m - 1 / (2 * b)) ** 2}[cfg.loss]()
        return losses.mean(), b * rc, b * rr
    if kind == "simpo":
        ac, ar = s_c / n_c, s_r / n_r
        return -F.logsigmoid(b * (ac - ar) - cfg.gamma).mean(), b * ac, b * ar
    if kind == "orpo":
        lc, lr = s_c / n_c, s_r / n_r  # mean token log-probabilities, <= 0

        def log_odds(lp):  # log p - log(1 - p), with log(1 - p) = log(-expm1(log p))
            return lp - torch.log(-torch.expm1(lp))
        nll = -s_c.sum() / n_c.sum()
        odds = -F.logsigmoid(log_odds(lc) - log_odds(lr))
        return nll + b * odds.mean(), b * lc, b * lr
    raise ValueError(f"unknown objective {kind!r}")


def sequence_weights(kind: str, cfg: PreferenceConfig, logps: torch.Tensor, counts: torch.Tensor,
                     reference: torch.Tensor | None, P: int, desirable: torch.Tensor | None = None
                     ) -> tuple[float, torch.Tensor, PairStats]:
    """The step's loss, ``-dL/dS`` of each row and the pair statistics.

    Args:
        logps, counts, reference: (2P,) fp32 of the step's rows in pair order: all chosen rows
            first, then the rejected ones (reference None for objectives without one).
        desirable: KTO's (P,) labels of the replies.
    """
    s = logps.detach().double().requires_grad_()
    n, ref = counts.double(), None if reference is None else reference.double()
    with torch.enable_grad():
        loss, wc, wr = pair_loss(kind, cfg, s[:P], s[P:], n[:P], n[P:],
                                 None if ref is None else ref[:P], None if ref is None else ref[P:],
                                 desirable)
        (grad,) = torch.autograd.grad(loss, s)
    wc, wr = wc.detach(), wr.detach()
    if kind == "kto":  # a reply is right when its reward has its label's sign
        right = float(((wc > 0).sum() + (wr < 0).sum()) / P)
    else:
        right = float((wc > wr).double().mean())
    mean = lambda t: float(t.mean()) if len(t) else float("nan")  # noqa: E731
    stats = PairStats(right, mean(wc), mean(wr), mean(wc) - mean(wr))
    return float(loss.detach()), (-grad).to(torch.float32), stats
