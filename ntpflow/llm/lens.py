"""Look-ahead lens (docs/paper.md#lookahead): linear maps from the residual at position t to the prediction of
token t + k.

The reference trains, per k in 1..5, ``x -> W_U^T (A x + b)`` with cross-entropy on token t+k
(Adam, 10 epochs, A identity-initialised) from ``blocks.15.hook_resid_pre`` - one block *before* the SAE's site
``blocks.15.hook_resid_post`` (quirk 6 of docs/reference-quirks.md). ntpflow fits the lens **at the SAE's own site**
and in **closed form**:

* target: the model's own final hidden state ``h_final`` (the input of the unembedding, after the final norm) at
  position ``t + k - 1``, i.e. what the model itself feeds to ``W_U`` when predicting token ``t + k``. Fitting
  ``W_U (A x + b)`` to the model's logits ``W_U h_final`` by least squares in logit space is the same problem as
  least squares ``A x + b ~ h_final`` in hidden space whenever ``W_U`` (``[V, d]``, V > d) has full column rank
  (``W_U`` can be absorbed: the minimiser of ``||W_U (A X - H)||`` is the minimiser of ``||A X - H||``). So the
  lens is one ``d x d`` ridge regression per k - seconds, no vocabulary-sized softmax - and it learns the model's
  own look-ahead readout rather than a fit to noisy one-hot targets. Like the reference, the lens then bypasses the
  final norm (and any logit soft-cap): logits are ``(A x + b) W_U^T``.
* ridge: ``lambda = ridge * trace(X^T X) / d`` on the centred inputs (the bias is not penalised).

Overlap of a latent with the lens: ``A = U S V^T``; for rank r, ``P_r`` projects onto the top-r right singular
vectors (input space) and ``overlap_r(f) = cos(E_f, P_r E_f) = ||V_r^T E_f|| / ||E_f||`` with ``E_f`` the SAE's
**encoder** column ``W_enc[:, f]`` (as the reference's notebook). The paper reports a negative correlation between
Q and this overlap; ``ntpflow.stats.spearman`` gives Spearman's rho with a Fisher-z 95% CI (standard error
``1.03 / sqrt(n - 3)``, Fieller et al. 1957).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ntpflow.stats import spearman


@dataclass
class Lens:
    """One look-ahead map ``y = A x + b`` (``A`` ``[d_out, d_in]``, ``b`` ``[d_out]``) for offset ``k``."""

    k: int
    A: torch.Tensor
    b: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., d_in]`` -> ``[..., d_out]``."""
        return x @ self.A.T + self.b


def fit_linear(X: torch.Tensor, Y: torch.Tensor, ridge: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge least squares ``Y ~ X A^T + b`` for ``X`` ``[N, d_in]``, ``Y`` ``[N, d_out]``; returns ``(A [d_out,
    d_in], b [d_out])`` in float64 -> float32. ``lambda = ridge * trace(Xc^T Xc) / d_in``; the bias is free."""
    if X.dim() != 2 or Y.dim() != 2 or X.shape[0] != Y.shape[0]:
        raise ValueError(f"X must be [N, d_in] and Y [N, d_out] with equal N, got {tuple(X.shape)} and "
                         f"{tuple(Y.shape)}")
    if X.shape[0] < 2:
        raise ValueError("need at least 2 rows to fit a lens")
    X, Y = X.double(), Y.double()
    mx, my = X.mean(0), Y.mean(0)
    Xc, Yc = X - mx, Y - my
    G = Xc.T @ Xc
    lam = ridge * float(G.diagonal().sum()) / X.shape[1]
    At = torch.linalg.solve(G + lam * torch.eye(X.shape[1], dtype=G.dtype), Xc.T @ Yc)  # [d_in, d_out]
    A = At.T
    b = my - mx @ At
    return A.float(), b.float()


def overlap(A: torch.Tensor, E: torch.Tensor, ranks: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{r: [S]}``: ``cos(E_f, P_r E_f)`` for each column ``E_f`` of ``E`` ``[d_in, S]`` and each rank ``r``."""
    _, _, Vh = torch.linalg.svd(A.double(), full_matrices=False)
    E = E.double()
    En = E.norm(dim=0).clamp(min=1e-30)
    proj = Vh @ E  # [d, S]: coordinates along the right singular vectors, in order
    csum = (proj ** 2).cumsum(0)
    out = {}
    for r in ranks:
        if not 1 <= r <= Vh.shape[0]:
            raise ValueError(f"rank {r} out of range 1..{Vh.shape[0]}")
        out[int(r)] = (csum[r - 1].sqrt() / En).float()
    return out


# ------------------------------------------------------------------------------------------------ data from a model


def _unembedding(adapter: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W_U [V, d], b_U [V] or None)`` of an HF or TransformerLens model (float32, CPU)."""
    model = adapter.model
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        head = model.get_output_embeddings()
        b = getattr(head, "bias", None)
        return head.weight.detach().float().cpu(), None if b is None else b.detach().float().cpu()
    if hasattr(model, "W_U"):  # TransformerLens: W_U [d, V]
        return model.W_U.detach().float().cpu().T, model.b_U.detach().float().cpu()
    raise TypeError("cannot find the unembedding of the model")


@torch.no_grad()
def final_hidden(adapter: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The input of the unembedding (after the final norm) ``[B, T, d]`` for ``tokens`` ``[B, T]``."""
    model = adapter.model
    tokens = tokens.to(adapter.device, torch.long)
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        store: dict[str, torch.Tensor] = {}

        def pre(module: Any, args: Any) -> None:
            store["h"] = args[0].detach().clone()

        handle = model.get_output_embeddings().register_forward_pre_hook(pre)
        try:
            model(input_ids=tokens, use_cache=False)
        finally:
            handle.remove()
        return store["h"]
    return adapter.activations(tokens, "ln_final.hook_normalized")


@torch.no_grad()
def lens_data(adapter: Any, tokens: torch.Tensor, hook: str, batch_size: int = 16, skip_first: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residuals at ``hook`` and final hidden states for ``tokens`` ``[N, L]``: ``([N, L, d], [N, L, d])`` float32
    on the CPU (position 0, BOS, is kept in the tensors; :func:`fit_lenses` skips the first ``skip_first``)."""
    adapter.check_hook(hook)
    xs, hs = [], []
    for i in range(0, tokens.shape[0], batch_size):
        t = tokens[i:i + batch_size]
        xs.append(adapter.activations(t, hook).float().cpu())
        hs.append(final_hidden(adapter, t).float().cpu())
    return torch.cat(xs), torch.cat(hs)


def _pairs(X: torch.Tensor, H: torch.Tensor, k: int, skip_first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(x_t, h_{t+k-1})`` for ``t = skip_first .. L - k``: ``([n, d], [n, d])``."""
    L = X.shape[1]
    if L - k < skip_first:
        raise ValueError(f"contexts of length {L} are too short for look-ahead k={k}")
    x = X[:, skip_first:L - k + 1]
    h = H[:, skip_first + k - 1:L]
    return x.reshape(-1, X.shape[-1]), h.reshape(-1, H.shape[-1])


def fit_lenses(X: torch.Tensor, H: torch.Tensor, tokens: torch.Tensor, W_U: torch.Tensor,
               b_U: torch.Tensor | None = None, ks: Sequence[int] = (1, 2, 3, 4, 5), ridge: float = 1e-4,
               train_frac: float = 0.8, skip_first: int = 1, seed: int = 0, eval_chunk: int = 1024
               ) -> tuple[list[Lens], list[dict]]:
    """Fit one lens per k on the first ``train_frac`` of the contexts (seeded permutation of rows of ``X``) and
    evaluate on the rest.

    Args:
        X: residuals at the SAE site ``[N, L, d]``.
        H: final hidden states ``[N, L, d]``.
        tokens: ``[N, L]``.
        W_U, b_U: unembedding ``[V, d]`` and bias ``[V]`` (or None).
        ks: look-ahead offsets.

    Returns:
        ``(lenses, metrics)``; metrics per k: ``top1`` (argmax of ``W_U (A x + b)`` equals token t+k on held-out
        contexts), ``agree`` (equals the model's own argmax at t+k-1), ``model_top1`` (the model's own accuracy on
        token t+k from position t+k-1, a ceiling), ``r2`` (held-out R^2 of the hidden-state fit), ``n_train``,
        ``n_test`` (rows).
    """
    N = X.shape[0]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(N, generator=g)
    n_tr = max(1, min(N - 1, round(train_frac * N)))
    tr, te = perm[:n_tr], perm[n_tr:]
    lenses, metrics = [], []
    for k in ks:
        xtr, htr = _pairs(X[tr], H[tr], k, skip_first)
        A, b = fit_linear(xtr, htr, ridge)
        lens = Lens(int(k), A, b)
        xte, hte = _pairs(X[te], H[te], k, skip_first)
        # rows of _pairs: t = skip_first .. L-k  ->  target token t+k = skip_first+k .. L (the last has no token)
        tgt_full = torch.cat([tokens[te][:, skip_first + k:], torch.full((te.numel(), 1), -1)], 1).reshape(-1)
        pred = lens(xte)
        ss_res = float(((pred - hte) ** 2).sum())
        ss_tot = float(((hte - hte.mean(0)) ** 2).sum())
        hit = agree = own = 0
        valid = 0
        for i in range(0, pred.shape[0], eval_chunk):
            lp = pred[i:i + eval_chunk] @ W_U.T
            lm = hte[i:i + eval_chunk] @ W_U.T
            if b_U is not None:
                lp, lm = lp + b_U, lm + b_U
            t = tgt_full[i:i + eval_chunk]
            m = t >= 0
            ap, am = lp.argmax(-1), lm.argmax(-1)
            hit += int((ap[m] == t[m]).sum())
            own += int((am[m] == t[m]).sum())
            agree += int((ap == am).sum())
            valid += int(m.sum())
        metrics.append({"k": int(k), "top1": hit / max(1, valid), "model_top1": own / max(1, valid),
                        "agree": agree / max(1, pred.shape[0]), "r2": 1.0 - ss_res / max(ss_tot, 1e-30),
                        "n_train": int(xtr.shape[0]), "n_test": int(xte.shape[0])})
        lenses.append(lens)
    return lenses, metrics


def lens_q_correlation(lenses: Sequence[Lens], E: torch.Tensor, latents: Sequence[int], q: Sequence[float],
                       included: Sequence[bool], ranks: Sequence[int]) -> dict:
    """Spearman correlation between Q and the lens overlap of each included latent, per (k, r).

    Args:
        lenses: fitted lenses.
        E: encoder ``[d_in, d_sae]``.
        latents, q, included: from a :class:`~ntpflow.llm.qscan.QScanResult`.
        ranks: ranks r of the projector.

    Returns:
        ``{"ranks": [...], "rows": [{"k", "r", "rho", "lo", "hi", "p", "n", "mean_overlap"}], "overlap":
        {k: {r: [S_included]}}, "latents": [S_included]}``.
    """
    keep = [(int(f), float(qq)) for f, qq, ok in zip(latents, q, included) if ok and not math.isnan(float(qq)) and qq > 0]
    lat = [f for f, _ in keep]
    qs = [qq for _, qq in keep]
    Es = E[:, lat] if lat else E[:, :0]
    rows, ov_all = [], {}
    for lens in lenses:
        ov = overlap(lens.A, Es, ranks)
        ov_all[lens.k] = {r: v.tolist() for r, v in ov.items()}
        for r, v in ov.items():
            s = spearman(qs, v.tolist())
            rows.append({"k": lens.k, "r": r, **s, "mean_overlap": float(v.mean()) if v.numel() else None})
    return {"ranks": [int(r) for r in ranks], "rows": rows, "overlap": ov_all, "latents": lat, "q": qs}
