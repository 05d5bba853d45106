"""Sparse autoencoders: one interface for sae-lens SAEs and our own, training with sae-lens, quality figures.

An SAE here is anything with ``encode(x [..., d_in]) -> f [..., d_sae]``, ``decode(f) -> x_hat [..., d_in]`` and
``W_dec [d_sae, d_in]``; sae-lens ``SAE`` objects (inference or training classes) qualify as they are, and
:class:`SimpleSAE` is a dependency-free one for tests. :func:`as_sae` checks an object and wraps it in
:class:`SAEHandle`, which also gives each latent's own contribution to the reconstruction.

:func:`train_sae` trains a TopK (default) or standard (ReLU + L1) SAE with the sae-lens training classes and a short
loop of our own (sae-lens's ``LanguageModelSAETrainingRunner`` wants a TransformerLens model and a hub dataset, which
this offline setting lacks). Activations are rescaled to mean norm ``sqrt(d_in)`` for training and the scale is folded
back into the weights afterwards, so the returned SAE works on raw activations. :func:`train_simple_sae` trains a
:class:`SimpleSAE` without sae-lens (the tiny test model's).

:func:`save_sae` / :func:`load_sae`: the one storage of both kinds, sae-lens's folder layout
(``sae_weights.safetensors`` + ``cfg.json``).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ntpflow.files import load_tensors, read_json, save_tensors, write_json
from ntpflow.progress import progress_of


class SimpleSAE(torch.nn.Module):
    """A minimal SAE: ``f = act(W_enc^T (x - b_dec) + b_enc)``, ``x_hat = f W_dec + b_dec``.

    ``act`` is TopK-then-ReLU when ``k`` is given, otherwise ReLU.

    Args:
        d_in: input width.
        d_sae: number of latents.
        k: TopK sparsity, or ``None`` for ReLU.
        seed: seed for the random initialisation.
    """

    def __init__(self, d_in: int, d_sae: int, k: int | None = None, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(d_sae, d_in, generator=g)
        w = w / w.norm(dim=1, keepdim=True)
        self.W_dec = torch.nn.Parameter(w)  # [d_sae, d_in]
        self.W_enc = torch.nn.Parameter(w.T.clone())  # [d_in, d_sae]
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in))
        self.k = k
        self.d_in, self.d_sae = d_in, d_sae

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d_in] -> f [..., d_sae]`` (non-negative)."""
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        if self.k is None:
            return pre.relu()
        vals, idx = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, idx, vals.relu())

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """``f [..., d_sae] -> x_hat [..., d_in]``."""
        return f @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def _width(sae: Any, name: str) -> int | None:
    cfg = getattr(sae, "cfg", None)
    for obj in (sae, cfg):
        v = getattr(obj, name, None) if obj is not None else None
        if isinstance(v, int):
            return v
    return None


class SAEHandle:
    """A checked view of an SAE.

    Attributes:
        sae: the wrapped object.
        d_in: input width.
        d_sae: number of latents.
    """

    def __init__(self, sae: Any):
        for attr in ("encode", "decode", "W_dec"):
            if not hasattr(sae, attr):
                raise TypeError(f"SAE object {type(sae).__name__} lacks {attr!r}")
        W = sae.W_dec
        if W.dim() != 2:
            raise ValueError(f"W_dec must be [d_sae, d_in], got shape {tuple(W.shape)}")
        self.sae = sae
        self.d_sae, self.d_in = int(W.shape[0]), int(W.shape[1])
        d_in = _width(sae, "d_in")
        if d_in is not None and d_in != self.d_in:
            raise ValueError(f"SAE d_in={d_in} but W_dec is {tuple(W.shape)}")

    @property
    def W_dec(self) -> torch.Tensor:
        """Decoder ``[d_sae, d_in]``."""
        return self.sae.W_dec

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d_in] -> f [..., d_sae]``."""
        return self.sae.encode(x)

    @torch.no_grad()
    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """``f [..., d_sae] -> x_hat [..., d_in]``."""
        return self.sae.decode(f)

    def check_width(self, d_model: int, hook: str = "") -> None:
        """Raise ``ValueError`` if the SAE's input width differs from the model's ``d_model``."""
        if self.d_in != d_model:
            where = f" at {hook!r}" if hook else ""
            raise ValueError(f"SAE width mismatch: SAE d_in={self.d_in} but the model's activation{where} has "
                             f"d_model={d_model}")

    @torch.no_grad()
    def ablated(self, x: torch.Tensor, latents: torch.Tensor, mode: str) -> torch.Tensor:
        """Activations with one latent ablated per row.

        Args:
            x: activations ``[n, d_in]``.
            latents: latent index per row ``[n]`` (int64).
            mode: ``"reconstruction"`` (the reference: ``decode(encode(x)`` with the latent zeroed``)``, which also
                drops the SAE error) or ``"error-preserving"`` (``x`` minus the latent's own contribution
                ``decode(f) - decode(f with the latent zeroed)``, so nothing else changes; for a linear decoder this is
                ``f_i W_dec[i]``, exactly zero for an inactive latent).

        Returns:
            ``[n, d_in]``.
        """
        if mode not in ("reconstruction", "error-preserving"):
            raise ValueError(f"mode must be 'reconstruction' or 'error-preserving', got {mode!r}")
        f = self.encode(x)
        rows = torch.arange(f.shape[0], device=f.device)
        f0 = f.clone()
        f0[rows, latents] = 0.0
        rec0 = self.decode(f0)
        if mode == "reconstruction":
            return rec0.to(x.dtype)
        active = f[rows, latents] != 0
        contrib = self.decode(f) - rec0
        contrib = torch.where(active[:, None], contrib, torch.zeros_like(contrib))
        return (x - contrib).to(x.dtype)


def as_sae(sae: Any) -> SAEHandle:
    """Wrap (and check) an SAE; an :class:`SAEHandle` is returned unchanged."""
    return sae if isinstance(sae, SAEHandle) else SAEHandle(sae)


@dataclass
class SAEQuality:
    """Quality of an SAE on a set of activations.

    Attributes:
        explained_variance: ``1 - sum ||x - x_hat||^2 / sum ||x - mean(x)||^2``.
        l0: mean number of active latents per token.
        dead_fraction: share of latents that never fire on these activations.
        n_dead: number of such latents.
        n_tokens: number of activation vectors evaluated.
    """

    explained_variance: float
    l0: float
    dead_fraction: float
    n_dead: int
    n_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def sae_quality(sae: Any, acts: torch.Tensor, batch_size: int = 4096) -> SAEQuality:
    """Explained variance, L0 and dead latents of ``sae`` on ``acts`` ``[N, d_in]``."""
    h = as_sae(sae)
    mean = acts.mean(0)
    se = tot = l0 = 0.0
    fired = None
    for i in range(0, acts.shape[0], batch_size):
        x = acts[i:i + batch_size]
        f = h.encode(x)
        xh = h.decode(f)
        se += float(((x - xh) ** 2).sum())
        tot += float(((x - mean) ** 2).sum())
        nz = f != 0
        l0 += float(nz.sum())
        fired = nz.any(0) if fired is None else fired | nz.any(0)
    if fired is None:
        raise ValueError("sae_quality needs at least one activation row, got acts of shape "
                         f"{list(acts.shape)}")
    n_dead = int((~fired).sum())
    return SAEQuality(1.0 - se / max(tot, 1e-30), l0 / acts.shape[0], n_dead / h.d_sae, n_dead, int(acts.shape[0]))


@torch.no_grad()
def collect_activations(adapter: Any, tokens: torch.Tensor, hook: str, batch_size: int = 16,
                        skip_first: int = 1) -> torch.Tensor:
    """Residual activations at ``hook`` for every position of ``tokens`` ``[N, T]`` except the first ``skip_first``
    (the BOS position, whose norm is atypically large). Forward passes stop right after the site.

    Returns:
        ``[N * (T - skip_first), d_model]`` float32 on the CPU.
    """
    adapter.check_hook(hook)
    out = []
    for i in range(0, tokens.shape[0], batch_size):
        a = adapter.activations(tokens[i:i + batch_size], hook)[:, skip_first:]
        out.append(a.reshape(-1, a.shape[-1]).float().cpu())
    return torch.cat(out)


@dataclass
class TrainSAEConfig:
    """Settings of :func:`train_sae`.

    Attributes:
        d_sae: number of latents.
        architecture: ``"topk"`` or ``"standard"`` (ReLU with an L1 penalty).
        k: TopK sparsity.
        l1_coefficient: L1 weight of the standard SAE (on activations rescaled to mean norm sqrt(d_in)).
        steps: optimiser steps.
        batch_size: activations per step.
        lr: Adam learning rate.
        dead_window: a latent is "dead" for the TopK auxiliary loss after this many steps without firing.
        seed: seed of the initialisation and of the batch order.
    """

    d_sae: int = 4096
    architecture: str = "topk"
    k: int = 32
    l1_coefficient: float = 5.0
    steps: int = 2000
    batch_size: int = 1024
    lr: float = 4e-4
    dead_window: int = 200
    seed: int = 0


def _make_training_sae(cfg: TrainSAEConfig, d_in: int) -> Any:
    if cfg.architecture == "topk":
        from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig

        return TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=cfg.d_sae, k=cfg.k))
    if cfg.architecture == "standard":
        from sae_lens.saes.standard_sae import (
            StandardTrainingSAE,
            StandardTrainingSAEConfig,
        )

        return StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=cfg.d_sae,
                                                             l1_coefficient=cfg.l1_coefficient))
    raise ValueError(f"architecture must be 'topk' or 'standard', got {cfg.architecture!r}")


def train_sae(acts: torch.Tensor, cfg: TrainSAEConfig | None = None, log_every: int = 0,
              progress: bool = False) -> tuple[Any, dict]:
    """Train an sae-lens SAE on activations with a short loop of our own.

    Args:
        acts: training activations ``[N, d_in]``.
        cfg: settings (:class:`TrainSAEConfig`).
        log_every: print the losses to stderr every this many steps (0: silent).
        progress: a bar over the steps (stage lines on stderr without a terminal).

    Returns:
        ``(sae, info)``: the sae-lens training SAE (in eval mode; ``encode``/``decode``/``W_dec`` work on raw
        activations) and a dict with the scale that was folded in and the final losses.
    """
    from sae_lens.saes.sae import TrainStepInput

    cfg = cfg or TrainSAEConfig()
    acts = acts.float()
    n, d_in = acts.shape
    scale = math.sqrt(d_in) / float(acts.norm(dim=1).mean())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        sae = _make_training_sae(cfg, d_in)
    with torch.no_grad():
        sae.b_dec.copy_((acts * scale).mean(0))
    coeffs = {}
    for name, c in sae.get_coefficients().items():
        coeffs[name] = c.value if hasattr(c, "value") else float(c)
    opt = torch.optim.Adam(sae.parameters(), lr=cfg.lr, betas=(0.9, 0.999))
    gen = torch.Generator().manual_seed(cfg.seed)
    since_fired = torch.zeros(cfg.d_sae, dtype=torch.long)
    losses: dict[str, float] = {}
    sae.train()
    for step in progress_of(range(cfg.steps), desc="SAE training", enabled=progress):
        idx = torch.randint(0, n, (cfg.batch_size,), generator=gen)
        x = acts[idx] * scale
        lr_frac = min(1.0, (cfg.steps - step) / max(1, cfg.steps // 5))  # linear decay over the last 20%
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_frac
        out = sae.training_forward_pass(TrainStepInput(
            sae_in=x, coefficients=coeffs, dead_neuron_mask=since_fired > cfg.dead_window,
            n_training_steps=step, is_logging_step=False))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        with torch.no_grad():
            fired = (out.feature_acts != 0).any(0)
            since_fired = torch.where(fired, torch.zeros_like(since_fired), since_fired + 1)
        if log_every and (step % log_every == 0 or step == cfg.steps - 1):
            losses = {k: float(v.detach()) for k, v in out.losses.items()}
            print(f"SAE step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in losses.items()), file=sys.stderr,
                  flush=True)
    losses = {k: float(v.detach()) for k, v in out.losses.items()}
    sae.eval()
    with torch.no_grad():  # fold the input scale into the weights (see module docstring)
        sae.W_enc.mul_(scale)
        sae.W_dec.div_(scale)
        sae.b_dec.div_(scale)
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae, {"scale": scale, "final_losses": losses, "config": asdict(cfg)}


def train_simple_sae(acts: torch.Tensor, d_sae: int, k: int = 8, steps: int = 300, batch_size: int = 256,
                     lr: float = 3e-3, seed: int = 0, progress: bool = False) -> tuple[SimpleSAE, dict]:
    """Train a TopK :class:`SimpleSAE` on ``acts`` ``[N, d_in]`` with Adam on the MSE (no sae-lens).

    Decoder rows are renormalised to unit norm after every step; ``b_dec`` starts at the data mean. Returns
    ``(sae, info)`` with the final loss. Seeded (initialisation and batch order). ``progress``: as in
    :func:`train_sae`.
    """
    acts = acts.float()
    n, d_in = acts.shape
    sae = SimpleSAE(d_in, d_sae, k=k, seed=seed)
    with torch.no_grad():
        sae.b_dec.copy_(acts.mean(0))
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    for _ in progress_of(range(steps), desc="SAE training", enabled=progress):
        x = acts[torch.randint(0, n, (min(batch_size, n),), generator=gen)]
        loss = ((sae(x) - x) ** 2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            sae.W_dec.div_(sae.W_dec.norm(dim=1, keepdim=True).clamp(min=1e-8))
    sae.eval()
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae, {"final_loss": float(loss.detach()), "config": {"d_sae": d_sae, "k": k, "steps": steps,
                                                        "batch_size": batch_size, "lr": lr, "seed": seed}}


def encoder_matrix(sae: Any) -> torch.Tensor:
    """The SAE's encoder ``W_enc`` as ``[d_in, d_sae]`` (float32, CPU)."""
    W = getattr(sae, "W_enc", None)
    if W is None:
        raise TypeError(f"SAE object {type(sae).__name__} has no W_enc")
    return W.detach().float().cpu()


# --------------------------------------------------------------------------------------------------------- storage

WEIGHTS_FILE, CFG_FILE = "sae_weights.safetensors", "cfg.json"  # sae-lens's names (sae_lens.constants)
SIMPLE_ARCHITECTURE = "ntpflow_simple"  # cfg.json["architecture"] of a SimpleSAE


def save_sae(sae: Any, path: str | Path) -> None:
    """Save an SAE into the folder ``path`` as ``sae_weights.safetensors`` + ``cfg.json`` (sae-lens's layout): a
    :class:`SimpleSAE` with ``{"architecture": "ntpflow_simple", d_in, d_sae, k}``, an sae-lens SAE in its own
    inference format. Written to a temporary sibling first and renamed (an existing folder is replaced)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if isinstance(sae, SimpleSAE):
        save_tensors(tmp / WEIGHTS_FILE, sae.state_dict())
        write_json(tmp / CFG_FILE, {"architecture": SIMPLE_ARCHITECTURE, "d_in": sae.d_in, "d_sae": sae.d_sae,
                                    "k": sae.k})
    else:
        sae.save_inference_model(str(tmp))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def load_sae(path: str | Path, device: str | torch.device = "cpu") -> Any:
    """Load an SAE saved by :func:`save_sae` (or any sae-lens SAE folder), frozen, in eval mode on ``device``."""
    path = Path(path)
    if not (path / CFG_FILE).exists():
        raise FileNotFoundError(f"no SAE in {path} (expected {CFG_FILE} and {WEIGHTS_FILE})")
    cfg = read_json(path / CFG_FILE)
    if cfg.get("architecture") != SIMPLE_ARCHITECTURE:
        from sae_lens import SAE

        return SAE.load_from_disk(str(path), device=str(device))
    sae = SimpleSAE(cfg["d_in"], cfg["d_sae"], k=cfg["k"])
    sae.load_state_dict(load_tensors(path / WEIGHTS_FILE))
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae.to(device).eval()
