"""Rounding-error bounds the numeric comparisons of the tests are derived from (issue 34, item 4).

u is the unit roundoff: 2**-24 for float32, 2**-8 for bfloat16. A sum or dot product of n terms computed in
any order is off by at most gamma(n) * sum|x_i| (Higham, "Accuracy and Stability of Numerical Algorithms",
3.1); a chain of such contractions adds their gammas to first order.
"""
from __future__ import annotations

U32 = 2.0 ** -24
U_BF16 = 2.0 ** -8
# LayerNorm/RMSNorm divide by the spread of `hidden` values, softmax and the activations amplify a relative
# error by a small factor on these tiny, freshly initialised models: 8 covers it (the observed errors are
# 10-100x under the bound, as the worst case sqrt(n) * u of a typical sum predicts).
AMPLIFICATION = 8


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term sum in any order."""
    return n * u / (1 - n * u)


def contraction_depth(config: dict, seq_len: int) -> int:
    """The summed lengths of the contractions a transformer's output passes through in series: per layer
    q/k/v projection (hidden), scores (head_dim), softmax and probabilities x V (seq_len each), output
    projection (hidden), MLP in (hidden) and out (intermediate); then the head (hidden)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    per_layer = hidden + head_dim + 2 * seq_len + hidden + hidden + inter
    return config["num_hidden_layers"] * per_layer + hidden


def forward_bound(config: dict, seq_len: int, u: float = U32) -> float:
    """Relative bound (of the largest |output|) on how far two evaluations of the same model on the same
    tokens can differ when only the order or blocking of their sums differs (another batch shape, a merged
    weight, another kernel): AMPLIFICATION * gamma(depth)."""
    return AMPLIFICATION * gamma(contraction_depth(config, seq_len), u)


def adam_update_bound(lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The most one Adam(W) step moves one element (weight decay aside): lr * |m_hat / (sqrt(v_hat) + eps)|
    <= lr * max(1, (1 - beta1) / sqrt(1 - beta2)) (Kingma & Ba 2015, section 2.1): 3.16 lr at the default
    betas. Two runs whose gradients differ only by rounding can still step an element in opposite directions
    where g is near 0, so after `steps` steps their weights differ by at most 2 * steps * this, whatever
    the trajectories did in between: a bound that holds but cannot see a small bug, hence each use keeps a
    second check on the mean difference."""
    beta1, beta2 = betas
    return lr * max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)
