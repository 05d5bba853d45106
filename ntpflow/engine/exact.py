"""The exact account kept while training: each site's influence accumulators, free of the final model.

At a site ⟨k, i⟩ and on the readout set H (N sequences) a feature w's mismatch is R(w) = wᵀ S w with S = mean_b e_b
e_bᵀ, e_b = r_b − r*_b, and r* the final model's residual: unknown while training. Along a component's update Δ_c (as
subtracted, θ ← θ − Σ_c Δ_c) the path integral of R's decrease splits into a part free of r* and a part linear in it:

    ∫₀¹ ∇R(θ_t − sΔ)·Δ_c ds = 2 wᵀ G_c w − 2 mean_b ⟨w, T_c,b⟩ ⟨w, r*_b⟩
    G_c = ∫₀¹ mean_b ṙ_b r_bᵀ ds  [d, d],    T_c = ∫₀¹ ṙ_b ds  [N, d],    ṙ_b = J_b(θ_t − sΔ) Δ_c

and the centred mismatch R_c (the covariance over H) the same with Ḡ_c = ∫ (mean_b ṙ_b)(mean_b r_b)ᵀ ds taken
from G_c and the means of T_c and r* from theirs. Both are sums over steps, so they are kept per chunk of steps (the
integrals by the same Gauss–Legendre points as the replay's exact account, ``InfluenceTracker.use_readout``);
:func:`chunk_values` contracts a chunk with r* and any directions afterwards: the probe rows and the influence
matrices (``chunk_matrices``: wᵀ M w is any direction w's row), without replaying the run.

Without r* a step's quadrature is judged by what it integrates exactly: the readout's displacement r_{t+1} − r_t
= −Σ T_full and the change of its second moment mean_b r rᵀ = −(G_full + G_fullᵀ) (the same refinement ladder as
the replay: more points, then the step split into pieces).

Rows per (kind, component), kind the reading: ``sgd`` (lr · g_c, the SGD direction) and the optimizer's own
(``adam``, ``adamw``, ``momentum``; ``sgd`` for plain SGD); components ``direct``, ``pre_cached``, ``full`` (the step
actually taken) and, under AdamW with weight decay, ``decay`` (lr · λ · θ_t, its own row, so that the rows still add
up to the change); ``shared`` = full − direct − pre_cached − decay.
"""

import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ntpflow.engine.decomposition import SitePasses
from ntpflow.engine.forward_mode import Primals
from ntpflow.engine.influence import (
    AdamStep,
    InfluenceTracker,
    MomentumStep,
    Readout,
    adam_second_moment,
    composite_gauss_legendre,
    plain_sgd,
)
from ntpflow.model.gpt import GPT
from ntpflow.model.loss import position_weights
from ntpflow.model.shapes import Mask, Tokens
from ntpflow.model.sites import Site

ACCUMULATORS = ("G", "Gbar", "T")  # per site: [rows, d, d], [rows, d, d], [rows, N, d]


def account_optimizer(opt: torch.optim.Optimizer) -> tuple[str, dict]:
    """(the own rows' name, the parameter group) of an optimizer the account supports: Adam ("adam"), AdamW
    ("adamw", decoupled weight decay), SGD ("sgd") or SGD with momentum ("momentum"); ValueError (one line)
    otherwise."""
    if len(opt.param_groups) != 1:
        raise ValueError("the account needs an optimizer with exactly one parameter group")
    g = opt.param_groups[0]
    if g.get("maximize", False):
        raise ValueError("the account needs maximize=False (a maximizing optimizer flips every sign)")
    decoupled = isinstance(opt, torch.optim.AdamW) or g.get("decoupled_weight_decay", False)
    if isinstance(opt, torch.optim.Adam) and not g.get("amsgrad", False):
        if g.get("weight_decay", 0) and not decoupled:
            raise ValueError("the account supports Adam's decoupled weight decay (AdamW), not its L2 penalty "
                             "(weight_decay on torch.optim.Adam): use torch.optim.AdamW")
        return ("adamw" if decoupled else "adam"), g
    if plain_sgd(opt) and not g.get("nesterov", False) and g.get("dampening", 0) == 0:
        if g.get("weight_decay", 0):
            raise ValueError("the account supports SGD without weight decay (use AdamW for a decayed run)")
        return ("momentum" if g.get("momentum", 0) else "sgd"), g
    raise ValueError(f"the account supports Adam, AdamW and SGD (with momentum, no dampening or Nesterov), not "
                     f"{type(opt).__name__} with these options")


def row_names(own: str, sgd_rows: bool, decay: bool) -> list[tuple[str, str]]:
    """The accumulated rows, (kind, component): the SGD direction's (direct, pre_cached, full) unless the run is
    plain SGD without ``sgd_rows``, then the optimizer's own (with ``decay`` under AdamW)."""
    rows = [("sgd", c) for c in ("direct", "pre_cached", "full")] if own == "sgd" or sgd_rows else []
    if own != "sgd":
        rows += [(own, c) for c in ("direct", "pre_cached", "full")] + ([(own, "decay")] if decay else [])
    return rows


class _Clipped:
    """A step's ``SitePasses`` with every gradient times ``factor`` (0-dim; gradient-norm clipping): the clip
    factor applies to every component, so the components still add up to the clipped gradient."""

    def __init__(self, passes: "SitePasses | _Summed", factor: torch.Tensor):
        self._passes, self.factor = passes, factor
        self.full, self.primals, self.loss = factor * passes.full, passes.primals, passes.loss
        self.param_grads = [None if g is None else factor * g for g in passes.param_grads]

    def has_pre_cached(self, site: Site) -> bool:
        return self._passes.has_pre_cached(site)

    def run_many(self, sites: Sequence[Site]) -> torch.Tensor:
        return self.factor * self._passes.run_many(sites)


class Shard:
    """This worker's part of the readout set when the account is kept by several workers (``torch.distributed``
    initialized; ``ntpflow.runs.workers``): rows ``rows`` of the N sequences, contiguous, in rank order; sums and
    gathers over the workers. With one worker every operation is the identity."""

    def __init__(self, n: int):
        on = dist.is_available() and dist.is_initialized()
        self.rank, self.size = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        self.bounds = [n * r // self.size for r in range(self.size + 1)]
        self.rows = slice(self.bounds[self.rank], self.bounds[self.rank + 1])
        if self.rows.start == self.rows.stop:
            raise ValueError(f"a readout of {n} sequences leaves worker {self.rank} of {self.size} none: use fewer "
                             "workers or a larger readout")

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the workers, in place (the same bits on every worker)."""
        if self.size > 1:
            dist.all_reduce(t)
        return t

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The workers' parts ``t`` (their rows of the readout along ``dim``) joined in rank order."""
        if self.size == 1:
            return t
        most = max(b - a for a, b in zip(self.bounds, self.bounds[1:]))
        pad = list(t.shape)
        pad[dim] = most - t.shape[dim]
        padded = torch.cat([t, t.new_zeros(pad)], dim).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return torch.cat([p.narrow(dim, 0, b - a) for p, a, b in zip(parts, self.bounds, self.bounds[1:])], dim)

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This worker's rows of a whole-readout tensor ``t`` along ``dim``."""
        return t.narrow(dim, self.rows.start, self.rows.stop - self.rows.start)


class _Summed:
    """A worker's ``SitePasses`` of its part of the batch (losses weighted by ``lm_loss_part``), every gradient summed
    over the workers: the whole batch's, the same on every worker."""

    def __init__(self, passes: SitePasses, shard: Shard):
        self._passes, self.shard = passes, shard
        self.full = shard.sum_(passes.full.clone())
        self.loss, self.primals = shard.sum_(passes.loss.clone()), passes.primals
        params = passes.params
        self.param_grads = [g.view_as(p) for g, p in zip(self.full.split([p.numel() for p in params]), params)]

    def has_pre_cached(self, site: Site) -> bool:
        return self._passes.has_pre_cached(site)

    def run_many(self, sites: Sequence[Site]) -> torch.Tensor:
        return self.shard.sum_(self._passes.run_many(sites))


class ExactAccount(InfluenceTracker):
    """The exact account of a training run, kept while it trains.

    ``account.train_step(tokens, loss_mask)`` takes the optimizer step of that batch (one ordinary backward, as
    ``training.train_step``; gradients clipped to norm ``clip`` if set) and adds its influence accumulators. Steps are
    grouped in chunks of ``chunk_steps``; each finished chunk goes to ``on_chunk(first_step, tensors)`` (default: kept
    in ``self.chunks``). ``state_dict``/``load_state_dict`` resume it. Nothing here reads the final model.

    model: the model being trained (its parameters are stepped); opt: its optimizer (:func:`account_optimizer`),
    whose learning rate is read at every step (any scheduler); sites: the residual sites; readout: tokens [N, pos]
    (N ≥ 2); levels, pieces, rtol, floor: the quadrature's refinement ladder (``InfluenceTracker.use_readout``).
    Under ``torch.distributed`` each worker decomposes its rows of the batch and integrates its rows of the readout
    (:class:`Shard`); the gradients are summed, every worker takes the same step, and the chunks, the state and every
    decision are the workers' together (equal to one worker's to rounding).
    """

    def __init__(self, model: GPT, opt: torch.optim.Optimizer, sites: Sequence[Site], readout: Tokens, *,
                 chunk_steps: int = 1, sgd_rows: bool = True, clip: float | None = None,
                 levels: Sequence[int] = (2, 4, 8), pieces: Sequence[int] = (2, 4, 8, 16), rtol: float = 1e-3,
                 floor: float = 1e-6, on_chunk: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
                 bucket_width: int | None = None, types: dict[str, torch.Tensor] | None = None):
        super().__init__(None, [], sgd_rows=sgd_rows, bucket_width=bucket_width, sites=sites, cfg=model.cfg)
        if not self.sites:
            raise ValueError("the account needs at least one site")
        if len(readout) < 2:
            raise ValueError("the readout set needs at least 2 sequences (R_c is a variance)")
        if chunk_steps < 1:
            raise ValueError(f"chunk_steps must be ≥ 1, not {chunk_steps}")
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be a positive gradient norm, not {clip}")
        if any(k < 2 for k in pieces) or list(pieces) != sorted(set(pieces)):
            raise ValueError(f"pieces must be increasing counts ≥ 2, not {tuple(pieces)}")
        self.model, self.opt, self.clip, self.chunk_steps = model, opt, clip, chunk_steps
        self.own, group = account_optimizer(opt)
        self.decay = self.own == "adamw" and group["weight_decay"] != 0
        self.names = row_names(self.own, sgd_rows, self.decay)
        n_pos = max(s.pos for s in self.sites) + 1
        self.shard, self.n_readout = Shard(len(readout)), len(readout)
        self.tokens = readout[:, :n_pos]  # the whole readout set [N, pos]
        mine = self.tokens[self.shard.rows]  # this worker's rows
        self.rule = Readout(mine, mine.new_zeros((len(mine), 0)), None, tuple(levels), rtol, floor,
                            tuple(pieces))  # the readout tokens and the quadrature's ladder
        self.on_chunk = on_chunk or (lambda first, tensors: self.chunks.append((first, tensors)))
        self.chunks: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._resid: dict[Site, torch.Tensor] | None = None  # the readout's residual at the step's start [N, d]
        self._norms: dict[Site, tuple[float, float]] = {}  # ‖r_0‖, ‖mean r_0 r_0ᵀ‖: the floor's scale
        self._chunk: dict[str, torch.Tensor] = {}  # the running chunk's tensors (see end_chunk)
        self._first = 0  # the running chunk's first step
        self._lr = 1.0
        self.types = {f: lab[:, :n_pos] for f, lab in (types or {}).items()}  # the whole readout's labels [N, pos]
        self._subsets = {s: self._typed_subsets(s) for s in self.sites}

    def _typed_subsets(self, site: Site) -> list[tuple[str, int, torch.Tensor, int]]:
        """The type subsets kept at ``site``: (feature, type, this worker's rows of it [n] bool, its size over the
        whole readout) for each feature of ``types`` and each type present at the site's position."""
        out = []
        for f, lab in self.types.items():
            col = lab[:, site.pos]
            mine = col[self.shard.rows]
            for t, n in zip(*torch.unique(col, return_counts=True)):
                out.append((f, int(t), mine == t, int(n)))
        return out

    # ---- one step ----
    def train_step(self, tokens: Tokens, loss_mask: Mask | None = None) -> torch.Tensor:
        """Take the training step of ``tokens`` [batch, T] (``loss_mask`` [batch, T]) and account for it; returns its
        loss (0-dim, before the step)."""
        passes = self.account_step(tokens, loss_mask)
        self.optimizer_step(passes)
        return passes.loss

    def optimizer_step(self, passes: "SitePasses | _Summed | _Clipped") -> None:
        """Take the step of the batch :meth:`account_step` just accounted for, on its gradients ``passes.param_grads``
        (one ordinary backward, as ``training.train_step``'s: the same bits); leaves ``.grad`` set."""
        self.opt.zero_grad(set_to_none=True)
        for p, g in zip(self.model.parameters(), passes.param_grads):
            p.grad = g
        self.opt.step()

    def account_step(self, tokens: Tokens, loss_mask: Mask | None = None) -> "SitePasses | _Summed | _Clipped":
        """Account for the training step of ``tokens`` [batch, T] (``loss_mask`` [batch, T]) from the model and
        optimizer as they are, without taking it; returns the step's passes (``param_grads``: the gradients the
        optimizer takes, clipped; ``loss``). For a loop that steps the weights itself, as a run group does
        (``ntpflow.runs.group``), with the model and optimizer holding the state before each step."""
        own, group = account_optimizer(self.opt)
        params = list(self.model.parameters())
        if self.shard.size == 1:
            passes: SitePasses | _Summed | _Clipped = SitePasses(self.model, tokens, self.sites, loss_mask)
        else:  # each worker decomposes its rows of the batch; the gradients are summed
            rows = Shard(len(tokens)).rows
            weights = position_weights(tokens, loss_mask)
            part = SitePasses(self.model, tokens[rows], self.sites, None if loss_mask is None else loss_mask[rows],
                              weights=weights)
            passes = _Summed(part, self.shard)
        if self.clip is not None:
            norm = passes.full.norm()
            passes = _Clipped(passes, torch.clamp(self.clip / (norm + 1e-6), max=1.0))
        lr = group["lr"]
        step: AdamStep | MomentumStep | None = None
        if own in ("adam", "adamw"):
            m_full, m_sites = self._moments(passes.full)
            step = AdamStep(*adam_second_moment(self.opt, params), group["betas"], group["eps"], m_full, m_sites)
        elif own == "momentum":
            step = MomentumStep(group["momentum"], *self._moments(passes.full))
        decay = None
        if self.decay:
            decay = lr * group["weight_decay"] * torch.cat([p.detach().reshape(-1) for p in params])
        self._account_step(passes, lr, step, decay)
        return passes

    def _moments(self, g_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tracker's first moments (full [n_params], sites [n_sites, 2, n_params]), allocated on first use."""
        self._ensure_moments(g_full)
        assert self._m_full is not None and self._m_sites is not None
        return self._m_full, self._m_sites

    def _account_step(self, passes, lr: float, adam, decay: torch.Tensor | None) -> None:
        self._begin_step(lr)
        previous = math.inf
        for level, (n, pieces) in enumerate(self.rule.rules):
            sink: dict[Site, dict[str, torch.Tensor]] = {}
            end = self._integral(passes, lr, adam, decay, n, pieces, level == 0, sink)
            excess = self._excess(sink, end)
            if self.rule.settles(level, excess, previous):
                break
            previous = excess
        self._end_step(sink, end, level)

    def _begin_step(self, lr: float) -> None:
        """Before a step of learning rate ``lr`` (the SGD rows' scale): the readout's residuals at its start (θ_0's, or
        a resumed step's, by a plain forward unless set already; later starts are the previous end), their sizes at
        θ_0, and a new chunk if none is running."""
        self._lr = lr
        if self._resid is None:
            self._resid = self._site_resid(Primals(self.model, self.rule.tokens, self.top_layer))
        if not self._norms:
            self._norms = {s: self._sizes(r) for s, r in self._resid.items()}
        if not self._chunk:
            self._first = self.step
            self._chunk = {f"start.{s.layer}:{s.pos}": r for s, r in self._resid.items()}

    def _end_step(self, sink: dict[Site, dict[str, torch.Tensor]], end: dict[Site, torch.Tensor], level: int) -> None:
        """After a step settled at rule ``level``: its integrals ``sink`` join the chunk, its end ``end`` {site: [N,
        d]} becomes the next start, and a full chunk goes out."""
        ro = self.rule
        for key, value in keyed(sink).items():
            self._chunk[key] = value if key not in self._chunk else self._chunk[key] + value
        self.evaluations += sum(n * k for n, k in ro.rules[:level + 1])
        self.refined += level > 0
        self.subdivided += ro.rules[level][1] > 1
        self._resid = end
        self.step += 1
        if self.step % self.chunk_steps == 0:
            self.end_chunk()

    def end_chunk(self) -> None:
        """Hand the running chunk, if it holds a step, to ``on_chunk(first_step, tensors)``: ``start.{site}`` and
        ``end.{site}`` [N, d] (the readout's residuals at its first step's start and its last step's end) and
        ``G``/``Gbar``/``T``.{site} (:data:`ACCUMULATORS`). Called every ``chunk_steps`` steps, and once at the end
        of training for a shorter last chunk; ``steps``: how many steps it holds."""
        if not self._chunk:
            return
        assert self._resid is not None  # a chunk holds a step, which set it
        tensors = self._whole({**self._chunk, **{f"end.{s.layer}:{s.pos}": r for s, r in self._resid.items()}})
        tensors["steps"] = torch.tensor(self.step - self._first)
        self._chunk = {}
        self.on_chunk(self._first, tensors)

    def _whole(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A chunk's tensors over the whole readout: the workers' rows of T and of the residuals gathered, their
        parts of G summed (Gbar is every worker's already)."""
        out = {}
        for key, t in tensors.items():
            name = key.split(".", 1)[0]
            out[key] = (self.shard.sum_(t.clone()) if name == "G" else t if name == "Gbar"
                        else self.shard.gather(t, 1 if name == "T" else 0))
        return out

    def _mine(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`_whole`: this worker's rows, and G on the first worker only (so the sum stays)."""
        out = {}
        for key, t in tensors.items():
            name = key.split(".", 1)[0]
            out[key] = ((t if self.shard.rank == 0 else torch.zeros_like(t)) if name == "G" else t
                        if name == "Gbar" else self.shard.take(t, 1 if name == "T" else 0))
        return out

    def _sizes(self, r: torch.Tensor) -> tuple[float, float]:
        """‖r‖ and ‖mean_b r_b r_bᵀ‖ of the whole readout's residuals (this worker's rows ``r`` [n, d])."""
        parts = self.shard.sum_(torch.cat([r.pow(2).sum()[None], (r.T @ r).flatten() / self.n_readout]))
        return float(parts[0].sqrt()), float(parts[1:].norm())

    def _site_resid(self, primals: Primals) -> dict[Site, torch.Tensor]:
        return {s: primals.resid[s.layer][:, s.pos].to(torch.float64) for s in self.sites}

    def _integral(self, passes, lr: float, adam, decay, n: int, pieces: int, update: bool, sink: dict,
                  shifted: Callable[[torch.Tensor, float], Primals] | None = None) -> dict[Site, torch.Tensor]:
        """One step by the ``n``-point rule on each of ``pieces`` parts: fills ``sink`` {site: G, Gbar, T}; returns
        the readout's residuals at the step's end {site: [N, d]}. ``shifted(step, s)``: the readout's ``Primals`` at
        θ − s·step (default: on scratch copies of the model; the run axis passes a functional one, so that this runs
        under ``torch.func.vmap``)."""
        shared_dirs, scale, sgd = self._shared_directions(passes.full, lr, adam, update)
        if decay is not None:
            shared_dirs = torch.cat([shared_dirs, decay[None]])
        step = (shared_dirs[-2] + decay if decay is not None else shared_dirs[-1]) if adam is not None \
            else lr * passes.full  # the real step, as subtracted
        scratch = itertools.count()
        tokens = self.rule.tokens

        def points(s: float) -> Primals:
            if shifted is not None:
                return shifted(step, s)
            return Primals(self._point(self.model, step, s, next(scratch) % (n + 1)), tokens, self.top_layer)

        end = self._site_resid(points(1.0))
        rule = composite_gauss_legendre(n, pieces)
        for j in range(pieces):
            nodes = [(weight, points(s), []) for s, weight in rule[j * n:(j + 1) * n]]
            self._integrate(passes, nodes, self.directions, shared_dirs, scale, sgd, adam, update and j == 0,
                            mats=sink)
        return end

    def _matrix_terms(self, mats: dict, site: Site, resid: torch.Tensor, tau: torch.Tensor, weight, with_pre: bool,
                      sgd: bool, adam: bool) -> None:
        """Add one quadrature point's ω_j (mean_b ṙ_b r_bᵀ, (mean_b ṙ_b)(mean_b r_b)ᵀ, ṙ) of every row to
        ``mats[site]``: ``resid`` [N, d] the site's residual at the point, ``tau`` [m, N, d] its tangents along the
        bucket's directions (the SGD parts, the optimizer's parts, then the shared ones: g_full, the optimizer's
        step, the decay)."""
        mix = self._mixing(with_pre, sgd, adam, tau)
        t = torch.einsum("rm,mnd->rnd", mix, tau.to(torch.float64))  # [rows, N, d]
        r = resid.to(torch.float64)
        w = 1.0 if weight is None else weight
        terms = {"T": w * t}
        for key, rows, n in [("", None, self.n_readout)] + [(f"|{ty}|{f}", m, n) for f, ty, m, n in self._subsets[site]]:
            ts, rs = (t, r) if rows is None else (t[:, rows], r[rows])
            sums = self.shard.sum_(torch.cat([ts.sum(1).flatten(), rs.sum(0)])) / n  # the (sub)set's means, all rows
            t_mean, r_mean = sums[:-r.shape[1]].view(len(t), -1), sums[-r.shape[1]:]
            terms[f"G{key}"] = w * torch.einsum("rnd,ne->rde", ts, rs) / n
            terms[f"Gbar{key}"] = w * t_mean[:, :, None] * r_mean[None, None, :]
        acc = mats.setdefault(site, {})
        for k, v in terms.items():
            acc[k] = v if k not in acc else acc[k] + v

    def _mixing(self, with_pre: bool, sgd: bool, adam: bool, like: torch.Tensor) -> torch.Tensor:
        """[rows, m]: each accumulated row (``self.names``) as a combination of the bucket's tangent directions."""
        n_own = 2 if with_pre else 1
        shared = n_own * (sgd + adam)  # the first shared direction
        mix = torch.zeros((len(self.names), shared + sgd + adam + (self.decay and adam)), dtype=torch.float64)
        for j, (kind, comp) in enumerate(self.names):
            on_sgd = kind == "sgd"
            base, scale = (0, self._lr) if on_sgd else (n_own * sgd, 1.0)
            if comp == "direct":
                mix[j, base] = scale
            elif comp == "pre_cached" and with_pre:
                mix[j, base + 1] = scale
            elif comp == "full":
                mix[j, shared + (0 if on_sgd else sgd)] = scale
                if not on_sgd and self.decay:
                    mix[j, shared + sgd + 1] = 1.0
            elif comp == "decay":
                mix[j, shared + sgd + 1] = 1.0
        return mix.to(like.device)

    def _excess(self, sink: dict, end: dict[Site, torch.Tensor]) -> float:
        """The worst site's error of what the step's rule integrates exactly, over its tolerance (0 within): the
        displacement r_end − r_start + T_full and the second moment's change + G_full + G_fullᵀ, each against
        rtol × its change + floor × its size, the larger of θ_0's and the step's start's (the float32 rounding of
        r_end − r_start scales with the residuals' current size, which training can grow many times over θ_0's: a
        floor on θ_0's alone sat below that rounding, and more points never reached it)."""
        ro, real = self.rule, self._real_row()
        worst = torch.zeros((), dtype=torch.float64)
        assert self._resid is not None
        for s, acc in sink.items():
            start, stop = self._resid[s], end[s]
            moved = stop - start
            g = acc["G"][real]
            held = start.T @ start / self.n_readout
            second = stop.T @ stop / self.n_readout - held
            parts = self.shard.sum_(torch.cat([(moved + acc["T"][real]).pow(2).sum()[None], moved.pow(2).sum()[None],
                                               start.pow(2).sum()[None], (second + g + g.T).flatten(),
                                               second.flatten(), held.flatten()]))
            d2 = g.numel()
            moment = [parts[3 + j * d2:3 + (j + 1) * d2].norm() for j in range(3)]  # error, change, size at start
            for err, change, now, at_0 in ((parts[0].sqrt(), parts[1].sqrt(), parts[2].sqrt(), self._norms[s][0]),
                                           (*moment, self._norms[s][1])):
                tol = ro.rtol * change + ro.floor * torch.clamp(now, min=at_0)
                worst = torch.maximum(worst, torch.where(err <= tol, 0.0, err / tol))
        return float(worst)

    def _real_row(self) -> int:
        """The row of the step actually taken: the optimizer's own full."""
        return self.names.index((self.own, "full"))

    # ---- resuming ----
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tracker's state (step, moments), the readout's residual at the next step's start, the running chunk
        and the counters."""
        state = super().state_dict()
        state.update({f"account.chunk.{k}": v for k, v in self._whole(self._chunk).items()})
        state["account.first"] = torch.tensor(self._first)
        if self._resid is not None:
            state.update({f"account.resid.{s.layer}:{s.pos}": self.shard.gather(r, 0) for s, r in self._resid.items()})
            state.update({f"account.norms.{s.layer}:{s.pos}": torch.tensor(v, dtype=torch.float64)
                          for s, v in self._norms.items()})
        state.update({f"account.{k}": torch.tensor(getattr(self, k))
                      for k in ("refined", "evaluations", "subdivided")})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith("account.")})
        self._chunk = self._mine({k[len("account.chunk."):]: v for k, v in state.items()
                                  if k.startswith("account.chunk.")})
        resid = {k[len("account.resid."):]: self.shard.take(v, 0) for k, v in state.items()
                 if k.startswith("account.resid.")}
        self._resid = {s: resid[f"{s.layer}:{s.pos}"] for s in self.sites} if resid else None
        self._norms = {s: tuple(state[f"account.norms.{s.layer}:{s.pos}"].tolist()) for s in self.sites
                       if f"account.norms.{s.layer}:{s.pos}" in state}
        for k in ("refined", "evaluations", "subdivided", "first"):
            setattr(self, k if k != "first" else "_first", int(state.get(f"account.{k}", 0)))


def chunk_key(site: Site, kind: str, type_: str | None = None, feature: str | None = None) -> str:
    """A chunk tensor's name: ``{kind}.{layer}:{pos}`` (kind G, Gbar, T, start, end), and for a type subset's G and
    Gbar ``{kind}.{layer}:{pos}.{type}.{feature}``."""
    return f"{kind}.{site.layer}:{site.pos}" + ("" if type_ is None else f".{type_}.{feature}")


def keyed(sink: dict[Site, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A step's integrals {site: {``G``, ``Gbar``, ``T``, ``G|type|feature``, ...}} under their chunk names
    (:func:`chunk_key`)."""
    return {chunk_key(s, *name.split("|")): value for s, acc in sink.items() for name, value in acc.items()}


def chunk_values(tensors: dict[str, torch.Tensor], site: Site, r_star: torch.Tensor, w: torch.Tensor,
                 subset: tuple[str, int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One chunk's values at ``site`` for directions ``w`` [n, d] (float64), given θ*'s readout residuals ``r_star``
    [N, d]: ``influence`` [2 (paper, centred), rows, n] (each accumulated row's integrated influence, positive = toward
    the final value), ``risk`` [2, n] R_H at the chunk's start and ``change`` [2, n] its decrease over the chunk.
    ``subset`` (feature, type, rows [N] bool): the values on that type subset of the readout (kept by the account's
    ``types``)."""
    key = f"{site.layer}:{site.pos}"
    G, Gbar, T = (tensors[f"{a}.{key}"] for a in ACCUMULATORS)
    rows = None
    if subset is not None:
        f, ty, rows = subset
        G, Gbar, T = tensors[chunk_key(site, "G", str(ty), f)], tensors[chunk_key(site, "Gbar", str(ty), f)], T[:, rows]
        r_star = r_star[rows]
    rs = r_star.to(torch.float64)
    wG = torch.einsum("nd,rde,ne->rn", w, G, w)  # wᵀ G w per row and direction
    wGbar = torch.einsum("nd,rde,ne->rn", w, Gbar, w)
    pt, ps = T @ w.T, rs @ w.T  # [rows, N, n], [N, n]: ⟨w, T_b⟩, ⟨w, r*_b⟩
    cross = (pt * ps).mean(1)  # [rows, n]
    cross_c = cross - pt.mean(1) * ps.mean(0)
    influence = torch.stack([2 * (wG - cross), 2 * (wG - wGbar - cross_c)])

    def risks(r: torch.Tensor) -> torch.Tensor:
        d = (r - rs) @ w.T  # [N, n]
        return torch.stack([d.pow(2).mean(0), (d - d.mean(0)).pow(2).mean(0)])

    start, end = (tensors[f"{a}.{key}"] for a in ("start", "end"))
    if rows is not None:
        start, end = start[rows], end[rows]
    start, end = risks(start), risks(end)
    return {"influence": influence, "risk": start, "change": start - end}


def chunk_matrices(tensors: dict[str, torch.Tensor], site: Site, r_star: torch.Tensor) -> torch.Tensor:
    """One chunk's influence matrices at ``site`` [2 (paper, centred), rows, d, d]: M with wᵀ M w the row's
    influence on R(w) for any w (``chunk_values``), given θ*'s readout residuals ``r_star`` [N, d]."""
    key = f"{site.layer}:{site.pos}"
    G, Gbar, T = (tensors[f"{a}.{key}"] for a in ACCUMULATORS)
    rs = r_star.to(torch.float64)
    Q = torch.einsum("rnd,ne->rde", T, rs) / len(rs)  # mean_b T_b r*_bᵀ
    Qc = Q - T.mean(1)[:, :, None] * rs.mean(0)[None, None, :]
    M = torch.stack([G - Q, G - Gbar - Qc])
    return M + M.transpose(-1, -2)
