"""SEDD (ddp.sedd): the score entropy against the paper's formula computed by hand, the
graphs' closed forms against matrix exponentials, and SEDD/MDLM on a toy language.

The toy language is a fixed 4-state Markov chain; a tiny DiT trained a few hundred steps
must sample sequences whose token and bigram frequencies match the chain's within the
tolerances stated below (a model that ignores context, or a broken sampler, misses the
bigrams by far more: the chain's transition rows are far from uniform).
"""

from __future__ import annotations

import math

import pytest
import torch

from ddp import sedd
from ddp.errors import ConfigError


def _by_hand(
    graph: sedd.Graph, log_s: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, sigma_bar: float
) -> torch.Tensor:
    """The paper's denoising score entropy, term by term, from Q and exp(sigma_bar Q) as
    matrices (float64, plain Python loops): sum_{y != x} Q[x, y] (s_y - r_y log s_y +
    K(r_y)), r_y = p(y|x0) / p(x|x0), K(a) = a (log a - 1)."""
    q = graph.matrix()
    p = torch.linalg.matrix_exp(sigma_bar * q)  # p[y, x0] = p(x_t = y | x0)
    out = torch.zeros(x_t.shape, dtype=torch.float64)
    for i in range(x_t.shape[0]):
        for j in range(x_t.shape[1]):
            x, a = int(x_t[i, j]), int(x0[i, j])
            total = 0.0
            for y in range(graph.n):
                if y == x or q[x, y] == 0:
                    continue
                r = float(p[y, a] / p[x, a])
                s = math.exp(float(log_s[i, j, y]))
                k = r * (math.log(r) - 1) if r > 0 else 0.0
                total += float(q[x, y]) * (s - (r * float(log_s[i, j, y]) if r > 0 else 0) + k)
            out[i, j] = total
    return out


@pytest.mark.parametrize("name", ["absorbing", "uniform"])
def test_score_entropy_equals_the_papers_formula_by_hand(name: str) -> None:
    graph = sedd.make_graph(name, 4)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randint(0, 4, (2, 5), generator=g)
    x_t = graph.perturb(x0, torch.tensor([1.5, 1.5]), torch.Generator().manual_seed(1))
    if name == "absorbing":
        x_t[0, 0] = graph.n - 1  # at least one mask and one kept token
        x_t[0, 1] = x0[0, 1]
    else:
        x_t[0, 0] = x0[0, 0]  # at least one kept and one changed token
        x_t[0, 1] = (x0[0, 1] + 1) % 4
    log_s = torch.randn(2, 5, graph.n, generator=g, dtype=torch.float64)
    got = graph.score_entropy(log_s, x_t, x0, torch.tensor([0.7, 0.7]))
    want = _by_hand(graph, log_s, x_t, x0, 0.7)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), (got, want)
    assert (want > 0).any()


@pytest.mark.parametrize("name", ["absorbing", "uniform"])
def test_score_entropy_is_nonnegative_and_zero_at_the_true_score(name: str) -> None:
    graph = sedd.make_graph(name, 6)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, 6, (8, 16), generator=g)
    sb = torch.rand(8, generator=g) * 3 + 0.05
    x_t = graph.perturb(x0, sb, g)
    true = graph.ratios(x_t, x0, sb)
    zero = graph.score_entropy(torch.log(true), x_t, x0, sb)
    assert zero.abs().max() < 1e-5
    for _ in range(5):
        noisy = torch.log(true.clamp(min=1e-6)) + torch.randn(true.shape, generator=g)
        assert (graph.score_entropy(noisy, x_t, x0, sb) >= -1e-6).all()
    assert graph.score_entropy(torch.log(true) + 0.3, x_t, x0, sb).sum() > 1e-3


@pytest.mark.parametrize("name", ["absorbing", "uniform"])
def test_closed_forms_match_matrix_exponentials(name: str) -> None:
    graph = sedd.make_graph(name, 5)
    n, c = graph.n, 0.8
    q = graph.matrix()
    assert torch.allclose(q.sum(0), torch.zeros(n, dtype=torch.float64))  # columns sum to 0
    states = torch.arange(n)
    cs = torch.full((n,), c)
    fwd = torch.linalg.matrix_exp(c * q)
    assert torch.allclose(graph.transition(states, cs).double(), fwd.T, atol=1e-6)
    assert torch.allclose(graph.transition_into(states, cs).double(), fwd, atol=1e-6)
    assert torch.allclose(graph.rates_into(states).double(), q * (1 - torch.eye(n)), atol=1e-7)
    s = torch.rand(n, n, dtype=torch.float64)
    back = torch.linalg.matrix_exp(-c * q)
    assert torch.allclose(graph.stagger(s.float(), cs).double(), s @ back.T, atol=1e-5)


def test_noise_schedules_rate_is_the_derivative_of_the_total() -> None:
    t = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    for noise in (sedd.LogLinear(1e-3), sedd.Geometric(1e-3, 20.0)):
        h = 1e-6
        numeric = (noise.total(t + h) - noise.total(t - h)) / (2 * h)
        assert torch.allclose(noise.rate(t), numeric, rtol=1e-5)
    assert float(
        sedd.LogLinear(1e-3).total(torch.tensor(1.0, dtype=torch.float64))
    ) == pytest.approx(-math.log(1e-3))


def test_bad_names_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError, match="allowed: absorbing, uniform"):
        sedd.make_graph("absorb", 4)
    with pytest.raises(ConfigError, match="mdlm needs model.graph: absorbing"):
        sedd.diffusion_loss(
            lambda x, s: torch.zeros(*x.shape, 4),
            torch.zeros(1, 3).long(),
            sedd.Uniform(4),
            sedd.Geometric(),
            torch.rand(1),
            "mdlm",
        )


# ---- a toy language ----------------------------------------------------------------------
CHAIN = torch.tensor(
    [
        [0.05, 0.80, 0.10, 0.05],
        [0.10, 0.05, 0.80, 0.05],
        [0.05, 0.10, 0.05, 0.80],
        [0.80, 0.05, 0.10, 0.05],
    ]
)
LENGTH = 16
# Stated tolerances. The chain's rows put 0.8 on one successor; an untrained model (or a
# sampler that ignores context) samples successors near 0.25 each: bigram error >= 0.5.
TOKEN_TOL = 0.08  # max |sampled - true| over the 4 token frequencies (true: 0.25 each)
BIGRAM_TOL = 0.25  # max |sampled - true| over the 16 conditional bigram frequencies
UNIFORM_BIGRAM_TOL = 0.30  # the same for the uniform graph (measured: 0.25 after 800 steps)


def _chain(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.empty(n, LENGTH, dtype=torch.long)
    x[:, 0] = torch.randint(0, 4, (n,), generator=g)
    for j in range(1, LENGTH):
        x[:, j] = torch.multinomial(CHAIN[x[:, j - 1]], 1, generator=g).squeeze(1)
    return x


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.bincount(x.flatten(), minlength=4).float()
    pairs = torch.zeros(4, 4)
    pairs.index_put_(
        (x[:, :-1].flatten(), x[:, 1:].flatten()), torch.ones(x[:, 1:].numel()), accumulate=True
    )
    return tokens / tokens.sum(), pairs / pairs.sum(1, keepdim=True).clamp(min=1)


# The uniform graph learns more slowly (as in the paper, where it trails absorbing):
# it gets twice the steps and a looser bigram bound (UNIFORM_BIGRAM_TOL).
@pytest.mark.parametrize(
    ("graph_name", "schedule", "loss", "predictor", "steps"),
    [
        ("absorbing", "loglinear", "sedd", "analytic", 400),
        ("absorbing", "loglinear", "sedd", "euler", 400),
        ("uniform", "geometric", "sedd", "analytic", 800),
        ("absorbing", "loglinear", "mdlm", "analytic", 400),
    ],
)
def test_toy_language_samples_match_token_and_bigram_frequencies(
    graph_name: str, schedule: str, loss: str, predictor: str, steps: int
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a shared machine
    try:
        _train_and_check(graph_name, schedule, loss, predictor, steps)
    finally:
        torch.set_num_threads(threads)


def _train_and_check(graph_name: str, schedule: str, loss: str, predictor: str, steps: int) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    graph = sedd.make_graph(graph_name, 4)
    noise = sedd.make_noise(schedule, 1e-3, 8.0)
    model = sedd.DiT(graph.n, 64, 2, 4, cond_dim=32, max_len=LENGTH, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x0 = _chain(32, g)
        t = 1e-3 + (1 - 1e-3) * torch.rand(32, generator=g)
        value = sedd.diffusion_loss(model, x0, graph, noise, t, loss, g).mean()
        opt.zero_grad()
        value.backward()
        opt.step()
    model.eval()
    out = sedd.sample(
        model,
        graph,
        noise,
        (256, LENGTH),
        32,
        predictor,
        loss,
        generator=torch.Generator().manual_seed(5),
    )
    assert out.max() < 4  # no mask left, only data states
    tok, big = _stats(out)
    ref_tok, ref_big = _stats(_chain(4096, torch.Generator().manual_seed(9)))
    assert (tok - ref_tok).abs().max() < TOKEN_TOL, (tok, ref_tok)
    tol = UNIFORM_BIGRAM_TOL if graph_name == "uniform" else BIGRAM_TOL
    assert (big - ref_big).abs().max() < tol, (big, ref_big)


def test_an_untrained_model_fails_the_bigram_check() -> None:
    """The tolerance can fail: the zero-initialised DiT samples context-free tokens."""
    graph = sedd.make_graph("absorbing", 4)
    model = sedd.DiT(graph.n, 32, 1, 2, cond_dim=16, max_len=LENGTH, dropout=0.0).eval()
    out = sedd.sample(
        model,
        graph,
        sedd.LogLinear(),
        (256, LENGTH),
        16,
        generator=torch.Generator().manual_seed(5),
    )
    _, big = _stats(out)
    _, ref_big = _stats(_chain(4096, torch.Generator().manual_seed(9)))
    assert (big - ref_big).abs().max() > BIGRAM_TOL
