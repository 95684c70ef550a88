"""Score entropy discrete diffusion (SEDD; Lou, Meng and Ermon, ICML 2024), written from the
paper's formulas: transition graphs, noise schedules, the denoising score entropy loss, a
DiT-style transformer conditioned on the noise level, and the Euler and analytic (Tweedie)
samplers. The MDLM loss (Sahoo et al., 2024) is here too, as the comparison point.

Notation (the paper's). Tokens live in ``n`` states; a forward rate matrix ``Q`` (columns sum
to zero, ``Q[y, x]`` the rate of jumping from x to y) is scaled by the noise rate
``sigma(t)``, so the marginal of one token after total noise ``sigma_bar(t) = int_0^t sigma``
is ``exp(sigma_bar Q)[:, x0]``. The model gives a *concrete score* ``s(x_t)_y``, an estimate
of ``p_t(y) / p_t(x_t)`` for each position and every other state y; the reverse process
jumps x -> y at rate ``s(x)_y Q[x, y]``. Training minimises the diffusion-weighted
denoising score entropy, per position::

    sigma(t) * sum_{y != x_t} Q[x_t, y] * (s_y - r_y log s_y + K(r_y)),
    r_y = p(y | x0) / p(x_t | x0),   K(a) = a (log a - 1),

which is >= 0 (a Bregman divergence of ``s`` from ``r``), 0 exactly when ``s = r``, and whose
integral over t bounds ``-log p(x0)`` from above (the ELBO): its exponential, per token, is
the perplexity bound that evaluation reports. The bound here is the diffusion term only:
the prior term (the forward process's distance from the base distribution at t = 1) is left
out, as it is in the paper's own figures; it is about ``exp(-sigma_bar(1))`` per token.

Every graph below is given by closed forms of ``Q`` and ``exp(c Q)``; the tests check them
against ``torch.linalg.matrix_exp`` of the matrices written out.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ddp.errors import ConfigError

# Re-exported: recipes, tests and docs name them ``ddp.sedd.X``.
from ddp.sedd_model import DiT, DiTBlock, NoiseEmbedding, _rotate  # noqa: F401

GRAPHS = ("absorbing", "uniform")
SCHEDULES = ("loglinear", "geometric")
PREDICTORS = ("euler", "analytic")
LOSSES = ("sedd", "mdlm")


def _col(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sequence value (B,) shaped to broadcast over (B, ..., n)."""
    return v.reshape(v.shape + (1,) * (like.dim() - v.dim()))


# ---- transition graphs ----------------------------------------------------------------
class Graph:
    """A forward rate matrix ``Q`` over ``n`` states, through the few products SEDD needs.

    Tensors of states ``x`` have any shape ``S``; per-target tensors have shape ``S + (n,)``.
    """

    n: int
    absorbing: bool = False

    def matrix(self) -> torch.Tensor:
        """``Q`` written out (n, n), ``Q[y, x]`` the rate x -> y: for tests and reference."""
        raise NotImplementedError

    def rates_into(self, x: torch.Tensor) -> torch.Tensor:
        """``Q[x, y]`` for every y (0 at y = x): the weights of the score entropy, and the
        reverse process's jump rates divided by the score."""
        raise NotImplementedError

    def transition(self, x0: torch.Tensor, sigma_bar: torch.Tensor) -> torch.Tensor:
        """``p(x_t = y | x0) = exp(sigma_bar Q)[y, x0]`` for every y."""
        raise NotImplementedError

    def transition_into(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``exp(delta Q)[x, y]`` for every y: the chance that y becomes x under noise delta."""
        raise NotImplementedError

    def stagger(self, score: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``exp(-delta Q) s`` along the last axis (the analytic sampler's first factor)."""
        raise NotImplementedError

    def sample_prior(
        self,
        shape: tuple[int, ...],
        device: torch.device | str,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def perturb(
        self, x0: torch.Tensor, sigma_bar: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """A draw of ``x_t`` from ``transition(x0, sigma_bar)`` (sigma_bar per sequence)."""
        raise NotImplementedError

    def ratios(self, x_t: torch.Tensor, x0: torch.Tensor, sigma_bar: torch.Tensor) -> torch.Tensor:
        """``r_y = p(y | x0) / p(x_t | x0)``: the true concrete score given x0."""
        p = self.transition(x0, sigma_bar)
        return p / p.gather(-1, x_t.unsqueeze(-1))

    def score_entropy(
        self, log_score: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, sigma_bar: torch.Tensor
    ) -> torch.Tensor:
        """Denoising score entropy per position (shape of ``x_t``), without ``sigma(t)``.

        ``sum_{y != x_t} Q[x_t, y] (s_y - r_y log s_y + K(r_y))``; terms with r_y = 0 are
        ``s_y`` alone (the limits of ``r log s`` and ``K``), so a score of 0 where the
        truth is 0 costs nothing.
        """
        log_score = log_score.float()
        w = self.rates_into(x_t)
        r = self.ratios(x_t, x0, sigma_bar)
        pos = r > 0
        safe_r = torch.where(pos, r, torch.ones_like(r))
        s = torch.exp(log_score)
        neg = torch.where(pos, r * log_score, torch.zeros_like(r))
        k = torch.where(pos, r * (torch.log(safe_r) - 1), torch.zeros_like(r))
        term = torch.where(w > 0, s - neg + k, torch.zeros_like(s))  # 0 * inf stays 0
        return (w * term).sum(-1)


class Uniform(Graph):
    """``Q = 1 1^T / n - I``: each token jumps to a uniformly drawn state at rate 1."""

    def __init__(self, n: int) -> None:
        self.n = n

    def matrix(self) -> torch.Tensor:
        return torch.full((self.n, self.n), 1.0 / self.n, dtype=torch.float64) - torch.eye(
            self.n, dtype=torch.float64
        )

    def rates_into(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.full((*x.shape, self.n), 1.0 / self.n, device=x.device)
        return w.scatter(-1, x.unsqueeze(-1), 0.0)

    def transition(self, x0: torch.Tensor, sigma_bar: torch.Tensor) -> torch.Tensor:
        sb = _col(sigma_bar.float(), x0.unsqueeze(-1))
        stay = torch.exp(-sb)
        p = (-torch.expm1(-sb) / self.n).expand(*x0.shape, self.n).clone()
        return p.scatter_add(-1, x0.unsqueeze(-1), stay.expand(*x0.shape, 1).clone())

    def transition_into(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.transition(x, delta)  # Q is symmetric

    def stagger(self, score: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        ed = torch.exp(_col(delta.float(), score))
        return ed * score + (1 - ed) * score.mean(-1, keepdim=True)

    def sample_prior(
        self,
        shape: tuple[int, ...],
        device: torch.device | str,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        return torch.randint(0, self.n, shape, device=device, generator=generator)

    def perturb(
        self, x0: torch.Tensor, sigma_bar: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        move = -torch.expm1(-_col(sigma_bar.float(), x0))
        u = torch.rand(x0.shape, device=x0.device, generator=generator)
        jump = torch.randint(0, self.n, x0.shape, device=x0.device, generator=generator)
        return torch.where(u < move, jump, x0)


class Absorbing(Graph):
    """``Q = e_m 1^T - I`` (m = n - 1, the mask): each token jumps to the mask at rate 1."""

    absorbing = True

    def __init__(self, n: int) -> None:
        self.n = n
        self.mask = n - 1

    def matrix(self) -> torch.Tensor:
        q = -torch.eye(self.n, dtype=torch.float64)
        q[self.mask, :] += 1.0
        return q

    def rates_into(self, x: torch.Tensor) -> torch.Tensor:
        w = (x == self.mask).float().unsqueeze(-1).expand(*x.shape, self.n).clone()
        w[..., self.mask] = 0.0
        return w

    def transition(self, x0: torch.Tensor, sigma_bar: torch.Tensor) -> torch.Tensor:
        sb = _col(sigma_bar.float(), x0).unsqueeze(-1)
        p = torch.zeros(*x0.shape, self.n, device=x0.device)
        p[..., self.mask] = (-torch.expm1(-sb)).squeeze(-1).expand(x0.shape)
        stay = torch.exp(-sb).expand(*x0.shape, 1)
        p = p.scatter(-1, x0.unsqueeze(-1), stay)
        return p.where(x0.unsqueeze(-1) != self.mask, F.one_hot(x0, self.n).float())

    def transition_into(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        d = _col(delta.float(), x).unsqueeze(-1)
        masked = (x == self.mask).unsqueeze(-1)
        into_mask = (-torch.expm1(-d)).expand(*x.shape, self.n).clone()
        into_mask[..., self.mask] = 1.0
        keep = F.one_hot(x, self.n).float() * torch.exp(-d)
        return torch.where(masked, into_mask, keep)

    def stagger(self, score: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        ed = torch.exp(_col(delta.float(), score))
        out = ed * score
        out[..., self.mask] += ((1 - ed) * score.sum(-1, keepdim=True)).squeeze(-1)
        return out

    def sample_prior(
        self,
        shape: tuple[int, ...],
        device: torch.device | str,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        return torch.full(shape, self.mask, dtype=torch.long, device=device)

    def perturb(
        self, x0: torch.Tensor, sigma_bar: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        move = -torch.expm1(-_col(sigma_bar.float(), x0))
        u = torch.rand(x0.shape, device=x0.device, generator=generator)
        return torch.where(u < move, torch.full_like(x0, self.mask), x0)


def make_graph(name: str, n_tokens: int) -> Graph:
    """``n_tokens`` data states; the absorbing graph adds the mask as state ``n_tokens``."""
    if name == "absorbing":
        return Absorbing(n_tokens + 1)
    if name == "uniform":
        return Uniform(n_tokens)
    raise ConfigError(f"model.graph: {name!r}; allowed: {', '.join(GRAPHS)}")


# ---- noise schedules --------------------------------------------------------------------
class Noise:
    """``total(t) = sigma_bar(t)`` and ``rate(t) = d sigma_bar / dt`` on t in [0, 1]."""

    def total(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rate(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LogLinear(Noise):
    """``sigma_bar(t) = -log(1 - (1 - eps) t)``: the mask probability grows linearly in t
    (to 1 - eps at t = 1); the paper's choice for the absorbing graph."""

    def __init__(self, eps: float = 1e-3) -> None:
        self.eps = eps

    def total(self, t: torch.Tensor) -> torch.Tensor:
        return -torch.log1p(-(1 - self.eps) * t)

    def rate(self, t: torch.Tensor) -> torch.Tensor:
        return (1 - self.eps) / (1 - (1 - self.eps) * t)


class Geometric(Noise):
    """``sigma_bar(t) = sigma_min^(1-t) sigma_max^t``; the paper's choice for the uniform
    graph."""

    def __init__(self, sigma_min: float = 1e-4, sigma_max: float = 20.0) -> None:
        self.lo, self.hi = sigma_min, sigma_max

    def total(self, t: torch.Tensor) -> torch.Tensor:
        return self.lo ** (1 - t) * self.hi**t

    def rate(self, t: torch.Tensor) -> torch.Tensor:
        return self.total(t) * math.log(self.hi / self.lo)


def make_noise(
    name: str, sigma_min: float = 1e-4, sigma_max: float = 20.0, eps: float = 1e-3
) -> Noise:
    if name == "loglinear":
        return LogLinear(eps)
    if name == "geometric":
        return Geometric(sigma_min, sigma_max)
    raise ConfigError(f"model.noise: {name!r}; allowed: {', '.join(SCHEDULES)}")


# ---- losses -----------------------------------------------------------------------------
def log_score(
    raw: torch.Tensor, x_t: torch.Tensor, sigma_bar: torch.Tensor, graph: Graph, loss: str = "sedd"
) -> torch.Tensor:
    """The model's output as log concrete scores, with ``log s_{x_t} = 0`` (s = 1 at the
    current state, which the sampler's formulas use).

    Absorbing graph: the true score of a masked position is ``p(x0 = y | x_t) /
    (e^sigma_bar - 1)``, so the raw output is shifted by ``-log(e^sigma_bar - 1)`` and
    only has to learn the posterior: unnormalised for SEDD, but shifted by ``-log(n - 1)``
    too, so that a zero output (the zero-initialised model) is the uniform posterior and
    its scores start with their true sum; MDLM normalises it with a softmax. Uniform graph: the raw output is the log score.
    """
    raw = raw.float()
    if graph.absorbing:
        shift = _col(torch.log(torch.expm1(sigma_bar.float())), raw)
        data = raw[..., :-1]
        if loss == "mdlm":
            data = torch.log_softmax(data, -1)
        else:  # a zero output is then the uniform posterior: the scores' true sum at init
            data = data - math.log(graph.n - 1)
        raw = torch.cat([data - shift, torch.zeros_like(raw[..., -1:])], -1)
    return raw.scatter(-1, x_t.unsqueeze(-1), 0.0)


def diffusion_loss(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    graph: Graph,
    noise: Noise,
    t: torch.Tensor,
    loss: str = "sedd",
    generator: torch.Generator | None = None,
    weight: torch.Tensor | None = None,
    x_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence negative ELBO per token (nats) at times ``t``, one sample of x_t each
    (drawn here, or given: evaluation draws it per sequence from a seeded generator).

    ``sedd``: ``sigma(t) * sum_positions score_entropy``; ``mdlm`` (absorbing only):
    ``sigma(t) / (e^sigma_bar - 1) * sum_masked -log p(x0 | x_t)``: both estimate the
    same bound (with t ~ U(0, 1)). ``weight`` (B, L) counts positions (default all).
    """
    sb, rate = noise.total(t), noise.rate(t)
    if x_t is None:
        x_t = graph.perturb(x0, sb, generator)
    raw = model(x_t, sb)
    if loss == "mdlm":
        if not graph.absorbing:
            raise ConfigError("model.loss: mdlm needs model.graph: absorbing")
        logp = torch.log_softmax(raw.float()[..., :-1], -1)
        nll = -logp.gather(-1, x0.unsqueeze(-1)).squeeze(-1) * (x_t == graph.n - 1)
        per = nll * _col(rate / torch.expm1(sb), nll)
    elif loss == "sedd":
        per = graph.score_entropy(log_score(raw, x_t, sb, graph), x_t, x0, sb)
        per = per * _col(rate, per)
    else:
        raise ConfigError(f"model.loss: {loss!r}; allowed: {', '.join(LOSSES)}")
    if weight is None:
        return per.mean(-1)
    return (per * weight).sum(-1) / weight.sum(-1).clamp(min=1)


# ---- sampling ---------------------------------------------------------------------------
def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    p = probs.clamp(min=0).flatten(0, -2)
    p = p + (p.sum(-1, keepdim=True) <= 0).float()  # a row of zeros: any state, not a crash
    return torch.multinomial(p, 1, generator=generator).view(probs.shape[:-1])


@torch.no_grad()
def sample(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    graph: Graph,
    noise: Noise,
    shape: tuple[int, int],
    steps: int,
    predictor: str = "analytic",
    loss: str = "sedd",
    eps: float = 1e-5,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``shape`` sequences of states from the reverse process in ``steps`` steps, t: 1 -> eps,
    then one analytic step from eps to 0 that never leaves a mask.

    ``euler``: from x, jump to y with probability ``dsigma Q[x, y] s_y`` (stay otherwise).
    ``analytic`` (the paper's Tweedie tau-leaping): ``p(y) ~ (exp(-dsigma Q) s)_y
    exp(dsigma Q)[x, y]`` with ``dsigma = sigma_bar(t) - sigma_bar(t - dt)``.
    """
    if predictor not in PREDICTORS:
        raise ConfigError(f"monitoring.predictor: {predictor!r}; allowed: {', '.join(PREDICTORS)}")
    if steps < 1:
        raise ConfigError(f"monitoring.sample_steps: {steps}; allowed: an integer >= 1")
    b = shape[0]
    x = graph.sample_prior(shape, device, generator)
    ts = torch.linspace(1.0, eps, steps + 1, device=device, dtype=torch.float64)
    for i in range(steps + 1):
        t = ts[i].float().expand(b)
        sb = noise.total(t)
        s = torch.exp(log_score(model(x, sb), x, sb, graph, loss))
        if i == steps:  # denoise: all the remaining noise at once
            probs = graph.stagger(s, sb) * graph.transition_into(x, sb)
            if graph.absorbing:
                probs[..., graph.mask] = 0.0  # type: ignore[attr-defined]
        elif predictor == "euler":
            ds = _col(noise.rate(t) * float(ts[i] - ts[i + 1]), s)
            probs = ds * graph.rates_into(x) * s
            probs = probs.scatter(-1, x.unsqueeze(-1), 0.0)
            probs = probs.scatter(-1, x.unsqueeze(-1), 1 - probs.sum(-1, keepdim=True))
        else:
            delta = sb - noise.total(ts[i + 1].float().expand(b))
            probs = graph.stagger(s, delta) * graph.transition_into(x, delta)
        x = _draw(probs, generator)
    return x
