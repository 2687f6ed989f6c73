"""Each merge method against its formula on small hand-computed tensors, plus the identities it must keep."""

from __future__ import annotations

import math

import pytest
import torch

from entrenar.errors import ConfigError
from entrenar.merge import methods as M

T = torch.tensor


def gta(name, base, xs, weights, densities=None, **kw):
    spec = M.METHODS[name]
    densities = densities or [1.0] * len(xs)
    params = {**spec.global_params, **kw}
    return M.task_arithmetic_family(
        spec.recipe, base, xs, weights, densities, normalize=params["normalize"], lambda_=params["lambda"],
        rescale=M.rescale_norm(params), gammas=[kw.get("gamma", 0.01)] * len(xs),
        epsilons=[kw.get("epsilon", 0.15)] * len(xs),
        generators=[M.tensor_generator(0, "w", i) for i in range(len(xs))],
    )


def test_linear_weighted_average_and_sum():
    a, b = T([1.0, 2.0, 3.0]), T([3.0, 0.0, -1.0])
    assert torch.equal(M.linear([a, b], [1.0, 3.0]), T([(1 + 9) / 4, 2 / 4, (3 - 3) / 4]))
    assert torch.equal(M.linear([a, b], [1.0, 3.0], normalize=False), T([10.0, 2.0, 0.0]))
    with pytest.raises(ConfigError, match="sum to 0"):
        M.linear([a, b], [1.0, -1.0])


def test_slerp_formula_and_endpoints():
    v0, v1 = T([1.0, 0.0]), T([0.0, 2.0])  # 90 degrees apart
    out = M.slerp(0.5, v0, v1)
    s = math.sin(math.pi / 4) / math.sin(math.pi / 2)
    assert torch.allclose(out, T([s * 1.0, s * 2.0]))
    assert torch.allclose(M.slerp(0.0, v0, v1), v0) and torch.allclose(M.slerp(1.0, v0, v1), v1)
    # 60 degrees: sin((1-t)θ)/sinθ and sin(tθ)/sinθ at t=0.25
    v1 = T([0.5, math.sqrt(3) / 2]) * 3
    theta = math.pi / 3
    want = math.sin(0.75 * theta) / math.sin(theta) * v0 + math.sin(0.25 * theta) / math.sin(theta) * v1
    assert torch.allclose(M.slerp(0.25, v0, v1), want, atol=1e-6)


def test_slerp_falls_back_to_lerp_for_parallel_tensors():
    v0 = T([1.0, 2.0, 3.0])
    v1 = v0 * 2 + 1e-4
    assert torch.allclose(M.slerp(0.3, v0, v1), 0.7 * v0 + 0.3 * v1)
    assert torch.equal(M.slerp(0.3, v0, v0), v0)


def test_nuslerp_row_and_flat_modes():
    v0 = T([[1.0, 0.0], [1.0, 0.0]])
    v1 = T([[0.0, 1.0], [1.0, 0.0]])  # row 0 orthogonal, row 1 identical
    s = math.sin(math.pi / 4)
    out = M.nuslerp(0.5, v0, v1, flatten=False)
    assert torch.allclose(out, T([[s, s], [1.0, 0.0]]), atol=1e-6)
    flat = M.nuslerp(0.5, v0, v1, flatten=True)
    assert torch.allclose(flat, M.slerp(0.5, v0.reshape(-1), v1.reshape(-1)).reshape(2, 2), atol=1e-6)
    assert M.nuslerp_t([1.0, 3.0]) == 0.75 and M.nuslerp_t([1.0, -1.0]) == 0.5


def test_task_arithmetic_and_lambda():
    base = T([1.0, 1.0])
    xs = [T([2.0, 0.0]), T([1.5, 3.0])]  # deltas [1, -1] and [0.5, 2]
    out = gta("task_arithmetic", base, xs, [1.0, 0.5])
    assert torch.allclose(out, base + T([1 + 0.25, -1 + 1.0]))
    out = gta("task_arithmetic", base, xs, [1.0, 0.5], **{"lambda": 2.0, "normalize": True})
    assert torch.allclose(out, base + 2 * T([1.25, 0.0]) / 1.5)


def test_ties_trim_elect_disjoint_mean():
    base = torch.zeros(4)
    x1 = T([3.0, -2.0, 0.1, 1.0])  # density 0.5 keeps |3| and |-2|
    x2 = T([1.0, 4.0, -5.0, 0.2])  # keeps 4 and -5
    out = gta("ties", base, [x1, x2], [1.0, 1.0], [0.5, 0.5])
    # trimmed: [3,-2,0,0] and [0,4,-5,0]; elected signs of the sums [3,2,-5,0] -> [+,+,-,+]
    # entry 0: only 3 agrees -> 3/1; entry 1: only 4 -> 4; entry 2: -5; entry 3: no one -> 0
    assert torch.allclose(out, T([3.0, 4.0, -5.0, 0.0]))
    # weights enter the vote and the mean: entry 1 with w=(3,1): votes -6+4 < 0 -> -2 wins
    out = gta("ties", base, [x1, x2], [3.0, 1.0], [0.5, 0.5])
    assert torch.allclose(out, T([9.0 / 3, -6.0 / 3, -5.0 / 1, 0.0]))


def test_sign_consensus_count_differs_from_sum():
    d = T([[5.0], [-1.0], [-1.0]])
    assert M.sign_consensus(d, "sum").reshape(-1).tolist() == [True, False, False]
    assert M.sign_consensus(d, "count").reshape(-1).tolist() == [False, True, True]


def test_magnitude_keeps_top_k():
    d = T([0.5, -3.0, 2.0, -0.1])
    assert torch.equal(M.magnitude(d, 0.5), T([0.0, -3.0, 2.0, 0.0]))
    assert torch.equal(M.magnitude(d, 1.0), d)
    assert torch.allclose(M.magnitude(d, 0.5, "l1"), T([0.0, -3.0, 2.0, 0.0]) * (5.6 / 5.0))


def test_dare_rescale_l1_and_inverse_density():
    d = torch.randn(1000)
    g = lambda: M.tensor_generator(7, "x")  # noqa: E731
    kept_raw = M.random_drop(d, 0.3, g(), None)
    mask = kept_raw != 0
    assert 200 < int(mask.sum()) < 400
    l1 = M.random_drop(d, 0.3, g(), "l1")
    assert torch.allclose(l1, kept_raw * d.abs().sum() / kept_raw.abs().sum())
    assert torch.allclose(M.random_drop(d, 0.3, g(), "inverse_density"), kept_raw / 0.3)
    assert torch.equal(M.random_drop(d, 0.3, g(), "l1"), l1)  # same seed and name: same mask


def test_tensor_generator_depends_on_seed_name_and_model():
    draw = lambda *a: torch.rand(4, generator=M.tensor_generator(*a))  # noqa: E731
    assert torch.equal(draw(1, "a", 0), draw(1, "a", 0))
    assert not torch.equal(draw(1, "a", 0), draw(2, "a", 0))
    assert not torch.equal(draw(1, "a", 0), draw(1, "b", 0))
    assert not torch.equal(draw(1, "a", 0), draw(1, "a", 1))


def test_breadcrumbs_drops_outliers_and_small():
    d = T([10.0, -1.0, 2.0, -3.0, 0.1, 4.0, 0.2, -5.0, 6.0, 0.3])
    # density 0.5 keeps 5, gamma 0.1 drops the 1 largest (10) and the 4 smallest (0.1, 0.2, 0.3, -1)
    out = M.magnitude_outliers(d, 0.5, 0.1)
    assert torch.equal(out, T([0.0, 0.0, 2.0, -3.0, 0.0, 4.0, 0.0, -5.0, 6.0, 0.0]))
    # gamma 0 keeps the top 5 (mergekit keeps nothing there: it slices [n_bot:-0])
    assert torch.equal(M.magnitude_outliers(d, 0.5, 0.0), M.magnitude(d, 0.5))


def test_della_keep_probability_follows_rank():
    d = torch.arange(1, 101, dtype=torch.float32).repeat(400, 1)  # every row ranks the same
    kept = M.della_magprune(d, 0.5, 0.4, M.tensor_generator(0, "d"), rescale=None) != 0
    rate = kept.float().mean(dim=0)
    # p = 0.1 + 0.8 * rank / 99: the smallest kept ~10%, the largest ~90%
    assert abs(rate[0].item() - 0.1) < 0.05 and abs(rate[-1].item() - 0.9) < 0.05
    with pytest.raises(ConfigError, match="epsilon"):
        M.della_magprune(d, 0.5, 0.5, M.tensor_generator(0, "d"))
    inv = M.della_magprune(d[:1], 0.5, 0.4, M.tensor_generator(1, "d"), rescale="inverse_density")
    p = 0.1 + 0.8 * torch.arange(100) / 99
    assert torch.allclose(inv[inv != 0], (d[0] / p)[inv[0] != 0])


def test_model_stock_formula():
    base = T([0.0, 0.0])
    x1, x2 = T([1.0, 0.0]), T([0.0, 1.0])  # orthogonal deltas: cos 0 -> t 0 -> the base
    assert torch.allclose(M.model_stock(base, [x1, x2]), base)
    x1, x2 = T([1.0, 1.0]), T([1.0, 0.0])  # cos = 1/sqrt 2
    c = 1 / math.sqrt(2)
    t = 2 * c / (1 + c)
    assert torch.allclose(M.model_stock(base, [x1, x2]), t * (x1 + x2) / 2, atol=1e-6)


@pytest.mark.parametrize("name", ["task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs",
                                  "breadcrumbs_ties", "della", "della_linear"])
def test_merging_a_model_with_itself_is_the_identity(name):
    torch.manual_seed(0)
    base = torch.randn(8, 16)
    # Task vectors of zero: every family member returns the base.
    assert torch.equal(gta(name, base, [base.clone(), base.clone()], [0.6, 0.4], [0.5, 0.5]), base)


def test_identical_inputs_with_weights_summing_to_one_give_the_input():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    assert torch.allclose(M.linear([x, x, x], [0.2, 0.3, 0.5]), x)
    assert torch.allclose(M.slerp(0.4, x, x.clone()), x)
    assert torch.allclose(M.nuslerp(0.4, x, x.clone(), flatten=False), x)
    base = torch.randn(8, 16)
    # ties at density 1 with identical fine-tunes: base + delta
    assert torch.allclose(gta("ties", base, [x, x], [0.5, 0.5]), x, atol=1e-6)
    assert torch.allclose(gta("task_arithmetic", base, [x, x], [0.5, 0.5]), x, atol=1e-6)
    assert torch.allclose(M.model_stock(base, [x, x.clone()]), x, atol=1e-5)


def test_top_k_mask_is_exact_with_ties_at_the_cut():
    torch.manual_seed(0)
    values = torch.randn(10_000).abs()
    for k in (1, 17, 5000, 9999):
        want = torch.zeros(10_000, dtype=torch.bool)
        want[torch.topk(values, k).indices] = True
        assert torch.equal(M.top_k_mask(values, k), want)
    tied = T([1.0, 3.0, 2.0, 2.0, 2.0, 0.5])  # the cut falls among the 2.0s: the lowest indices go in
    assert M.top_k_mask(tied, 3).tolist() == [False, True, True, True, False, False]
    assert M.top_k_mask(torch.zeros(4), 2).tolist() == [True, True, False, False]


def test_zero_dropped_is_masked_fill_bit_for_bit():
    d = T([-1.5, -0.0, 0.0, float("nan"), float("inf"), -2.0, 3.0, float("-inf")])
    keep = T([True, False, False, False, False, False, True, True])
    want = d.clone().masked_fill_(~keep, 0)
    got = M.zero_dropped(d.clone(), keep)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # +0.0 where dropped, NaN and -0.0 included


def test_combine_task_vectors_matches_the_where_formula():
    torch.manual_seed(0)
    base = torch.randn(40, 30)
    deltas = [torch.randn(40, 30) * (torch.rand(40, 30) < 0.5) for _ in range(3)]
    weights = [0.3, 1.0, -0.7]
    votes = sum(deltas)
    agree = [torch.where(votes >= 0, d > 0, d < 0) for d in deltas]
    mixed = sum(d.masked_fill(~a, 0) for d, a in zip(deltas, agree))
    divisor = sum(a.float() * w for a, w in zip(agree, weights))
    want = mixed / divisor.masked_fill(divisor == 0, 1) * 0.5 + base
    got = M.combine_task_vectors([d.clone() for d in deltas], base, weights, consensus="sum", normalize=True,
                                 lambda_=0.5)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", ["l1", "l2", "linf"])
def test_norms_by_rows_do_not_depend_on_the_grouping_and_match_float64(norm):
    torch.manual_seed(0)
    x = torch.randn(37, 300)
    whole = M.finish_norm([M.norm_parts(x, norm)], norm)
    grouped = M.finish_norm([M.norm_parts(x[a:b], norm) for a, b in ((0, 2), (2, 19), (19, 37))], norm)
    assert whole == grouped
    order = {"l1": 1, "l2": 2, "linf": float("inf")}[norm]
    assert math.isclose(whole, torch.linalg.vector_norm(x.double(), order).item(), rel_tol=1e-6)
