import json
import math

import numpy as np
import pytest
import torch

from ntpflow.probes import ProbeSet, fit_probes, fit_ridge, pearson, probe_table

sklearn_linear = pytest.importorskip("sklearn.linear_model")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- fit_ridge


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
@pytest.mark.parametrize("N,d", [(40, 6), (8, 12)])  # over- and under-determined
def test_fit_ridge_matches_sklearn(alpha, N, d):
    g = _gen(1)
    S, F = 4, 3
    X = torch.randn(S, N, d, generator=g, dtype=torch.float64) * 2 + 0.5
    Y = torch.randn(S, N, F, generator=g, dtype=torch.float64) + 3.0
    W, b = fit_ridge(X, Y, alpha)
    assert W.shape == (S, d, F) and b.shape == (S, F)
    assert W.dtype == torch.float64
    for s in range(S):
        ref = sklearn_linear.Ridge(alpha=alpha, fit_intercept=True).fit(X[s].numpy(), Y[s].numpy())
        np.testing.assert_allclose(W[s].numpy(), ref.coef_.T, atol=1e-6, rtol=0)
        np.testing.assert_allclose(b[s].numpy(), ref.intercept_, atol=1e-6, rtol=0)


def test_fit_ridge_dtype_chunking_and_errors():
    g = _gen(2)
    X = torch.randn(5, 30, 4, generator=g)
    Y = torch.randn(5, 30, 2, generator=g)
    W, b = fit_ridge(X, Y)
    assert W.dtype == torch.float32 and b.dtype == torch.float32
    W1, b1 = fit_ridge(X, Y, chunk_size=2)
    # the float64 solves of other batch sizes may differ in their last bits, which can move the float32 result by at
    # most one ulp; one float32 ulp of x is at most eps*|x|
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(W1, W, rtol=eps, atol=0)
    torch.testing.assert_close(b1, b, rtol=eps, atol=0)
    with pytest.raises(ValueError):
        fit_ridge(X, Y[:, :29])
    with pytest.raises(ValueError):
        fit_ridge(X[0], Y[0])
    with pytest.raises(ValueError):
        fit_ridge(X, Y, alpha=-1.0)


# ---------------------------------------------------------------- pearson


def test_pearson_matches_numpy():
    g = _gen(3)
    a = torch.randn(3, 50, 4, generator=g, dtype=torch.float64)
    c = 0.5 * a + torch.randn(3, 50, 4, generator=g, dtype=torch.float64)
    r = pearson(a, c)
    assert r.shape == (3, 4)
    for i in range(3):
        for f in range(4):
            ref = np.corrcoef(a[i, :, f].numpy(), c[i, :, f].numpy())[0, 1]
            assert r[i, f].item() == pytest.approx(ref, abs=1e-12)


def test_pearson_zero_variance_is_nan():
    x = torch.randn(10, 2, generator=_gen(4))
    y = x.clone()
    y[:, 1] = 0.1  # constant target
    r = pearson(x, y)
    assert r[0].item() == pytest.approx(1.0, abs=1e-6)
    assert math.isnan(r[1].item())
    assert math.isnan(pearson(y, x)[1].item())
    assert r.dtype == torch.float32


# ---------------------------------------------------------------- fit_probes


def _planted(n=60, T=4, d=8, L1=3, seed=5):
    """Feature 0 is exactly linear in resid at (last layer, pos 1); feature 1 is noise."""
    g = _gen(seed)
    resid = torch.randn(L1, n, T, d, generator=g)
    features = torch.randn(n, T, 2, generator=g)
    u = torch.randn(d, generator=g)
    features[:, 1, 0] = resid[-1, :, 1] @ u + 0.7
    return resid, features, u


def test_fit_probes_recovers_planted_feature():
    resid, features, u = _planted()
    ps = fit_probes(resid, features, alpha=1e-3, feature_names=["lin", "noise"])
    L1, n, T, d = resid.shape
    assert ps.weights.shape == (L1, T, d, 2)
    assert ps.bias.shape == (L1, T, 2)
    assert ps.r.shape == (L1, T, 2)
    assert ps.positions == (1, 2, 3)
    assert ps.metadata == {"n_train": 42, "n_test": 18}
    assert ps.r[2, 1, 0].item() > 0.999
    torch.testing.assert_close(ps.direction(2, 1, "lin"), u, atol=1e-2, rtol=0)
    # Noise: no site should do well on the noise feature.
    probed = ps.r[:, 1:]
    assert probed[..., 1].abs().max().item() < 0.8
    # Other sites for feature 0 are unrelated to the planted one.
    others = torch.cat([probed[:2, :, 0].flatten(), probed[2, 1:, 0]])
    assert others.abs().max().item() < 0.8
    # Position 0 (BOS) is not probed by default.
    assert torch.isnan(ps.r[:, 0]).all()
    assert torch.isnan(ps.weights[:, 0]).all()
    with pytest.raises(ValueError):
        ps.direction(0, 0, 0)
    # predict agrees with the planted map at the planted site, on the test rows.
    pred = ps.predict(resid)
    assert pred.shape == (L1, n, T, 2)
    torch.testing.assert_close(pred[2, 42:, 1, 0], features[42:, 1, 0], atol=5e-2, rtol=0)
    assert torch.isnan(pred[:, :, 0]).all()


def test_fit_probes_matches_sklearn_per_site():
    resid, features, _ = _planted(n=30, T=3, d=5, L1=2, seed=6)
    ps = fit_probes(resid.double(), features.double(), positions=[0, 2])
    assert ps.positions == (0, 2)
    assert torch.isnan(ps.r[:, 1]).all()
    n_tr = 21
    for layer in range(2):
        for p in (0, 2):
            X = resid[layer, :, p].double().numpy()
            Y = features[:, p].double().numpy()
            ref = sklearn_linear.Ridge(alpha=1.0).fit(X[:n_tr], Y[:n_tr])
            np.testing.assert_allclose(ps.weights[layer, p].numpy(), ref.coef_.T, atol=1e-8)
            np.testing.assert_allclose(ps.bias[layer, p].numpy(), ref.intercept_, atol=1e-8)
            yhat = ref.predict(X[n_tr:])
            for f in range(2):
                want = np.corrcoef(yhat[:, f], Y[n_tr:, f])[0, 1]
                assert ps.r[layer, p, f].item() == pytest.approx(want, abs=1e-8)


def test_r_by_type_matches_subset_pearson():
    resid, features, _ = _planted(n=50, T=3, d=4, L1=2, seed=7)
    types = torch.randint(0, 3, features.shape, generator=_gen(8))
    types[:, :, 1] = 5  # feature 1: single type
    ps = fit_probes(resid, features, feature_types=types)
    assert set(ps.r_by_type) == {0, 1, 2, 5}
    pred = ps.predict(resid)
    n_tr = 35
    for t in (0, 1, 2):
        for layer in range(2):
            for p in (1, 2):
                m = types[n_tr:, p, 0] == t
                want = pearson(pred[layer, n_tr:, p, 0][m, None].double(), features[n_tr:, p, 0][m, None].double())
                got = ps.r_by_type[t][layer, p, 0]
                assert got.item() == pytest.approx(want.item(), abs=1e-5)
        assert torch.isnan(ps.r_by_type[t][:, :, 1]).all()  # type absent for feature 1
    torch.testing.assert_close(ps.r_by_type[5][:, 1:, 1], ps.r[:, 1:, 1], atol=1e-6, rtol=0)
    assert torch.isnan(ps.r_by_type[5][:, :, 0]).all()


def test_r_by_type_single_row_is_nan():
    resid, features, _ = _planted(n=20, T=2, d=3, L1=1, seed=9)
    types = torch.zeros(features.shape, dtype=torch.long)
    types[-1, 1, 0] = 1  # only one test row of type 1
    ps = fit_probes(resid, features, feature_types=types)
    assert math.isnan(ps.r_by_type[1][0, 1, 0].item())
    assert not math.isnan(ps.r_by_type[0][0, 1, 0].item())


def test_save_load_roundtrip(tmp_path):
    resid, features, _ = _planted(n=30, T=3, d=4, L1=2, seed=10)
    types = torch.randint(-1, 2, features.shape, generator=_gen(11))
    ps = fit_probes(resid, features, feature_types=types, feature_names=["a", "b"], alpha=2.5)
    ps.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["probes.json", "probes.safetensors"]
    meta = json.loads((tmp_path / "out" / "probes.json").read_text())
    assert meta["feature_names"] == ["a", "b"] and meta["alpha"] == 2.5
    q = ProbeSet.load(tmp_path / "out")
    same = dict(equal_nan=True, atol=0, rtol=0)  # exact: save/load round trip of the same tensors
    torch.testing.assert_close(q.weights, ps.weights, **same)
    torch.testing.assert_close(q.bias, ps.bias, **same)
    torch.testing.assert_close(q.r, ps.r, **same)
    assert set(q.r_by_type) == set(ps.r_by_type) and -1 in q.r_by_type
    for t in ps.r_by_type:
        torch.testing.assert_close(q.r_by_type[t], ps.r_by_type[t], **same)
    assert (q.feature_names, q.alpha, q.train_frac, q.positions, q.metadata) == (
        ps.feature_names, ps.alpha, ps.train_frac, ps.positions, ps.metadata,
    )
    # Overwrite in place works (atomic replace) and leaves no temp files.
    q.save(tmp_path / "out")
    assert len(list((tmp_path / "out").iterdir())) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(9, 3, 1)),  # n mismatch
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(10, 2, 1)),  # T mismatch
        dict(resid=torch.zeros(10, 3, 4), features=torch.zeros(10, 3, 1)),  # resid ndim
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(10, 3)),  # features ndim
        dict(resid=torch.zeros(2, 3, 3, 4), features=torch.zeros(3, 3, 1)),  # too few rows
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(10, 3, 1), feature_types=torch.zeros(10, 3, 2, dtype=torch.long)),
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(10, 3, 1), feature_types=torch.zeros(10, 3, 1)),  # float types
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(10, 3, 2), feature_names=["x"]),
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(10, 3, 1), positions=[3]),
        dict(resid=torch.zeros(2, 10, 3, 4), features=torch.zeros(10, 3, 1), train_frac=1.0),
        dict(resid=torch.zeros(2, 10, 1, 4), features=torch.zeros(10, 1, 1)),  # no default positions
    ],
)
def test_fit_probes_bad_inputs_raise(kwargs):
    with pytest.raises(ValueError):
        fit_probes(**kwargs)


def test_predict_bad_shape_raises():
    resid, features, _ = _planted(n=20, T=3, d=4, L1=2, seed=12)
    ps = fit_probes(resid, features)
    with pytest.raises(ValueError):
        ps.predict(resid[:, :, :, :3])


def test_probe_table_format():
    resid, features, _ = _planted()
    ps = fit_probes(resid, features, alpha=1e-3, feature_names=["lin", "noise"])
    text = probe_table(ps, "lin", positions=[0, 1, 2, 3])
    lines = text.splitlines()
    assert len(lines) == 2 + resid.shape[0]
    assert lines[1].split() == ["layer", "p0", "p1", "p2", "p3"]
    row2 = lines[4].split()
    assert row2[0] == "2" and row2[1] == "-" and row2[2] == "1.00"
    assert "  - " in lines[2]
    assert probe_table(ps, 1) == probe_table(ps, "noise")
