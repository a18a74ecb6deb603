"""The predictive objects (bayeswrap.methods.predictives) against naive loops and the old keyword arguments.

Each ``*_naive_loop`` test checks the default predictive of a method (what ``predict(x, S)`` did before the
predictives became objects, at e4ef897) against a plain Python loop over the draws; they use only the old API
and pass at e4ef897 too. The ``*_object`` tests check that passing the predictive object gives the same numbers.
"""

import copy

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.samples import spread_indices

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp(seed=0, dropout=False, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    layers.append(nn.ReLU())
    if dropout:
        layers.append(nn.Dropout(0.3))
    layers.append(nn.Linear(8, 3))
    return nn.Sequential(*layers)


def _data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _batches(x, y, size=8):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _gen(seed=3):
    return torch.Generator().manual_seed(seed)


def _softmax_mean(logits):
    return torch.stack([out.softmax(-1) for out in logits]).mean(0)


def _sgld():
    x, y = _data()
    bnn = bw.wrap(_mlp(), "sgld", num_data=64, burn_in=0, thinning=1, max_samples=10, chunk_size=3)
    opt = bw.optim.SGLD(bnn.parameters(), lr=1e-3, num_data=64, generator=_gen(0))
    bw.fit(bnn, _batches(x, y), epochs=2, optimizer=opt, progress=False)
    return bnn.eval(), x[:10]


def test_sgld_ensemble_predictive_is_the_mean_softmax_over_the_stored_draws_naive_loop():
    bnn, x = _sgld()
    store = bnn.sample_store
    assert len(store) == 8  # 16 iterates kept into 10 slots: every second one
    for s in (1, 4, 7, 8, 13):
        draws = store.draws(spread_indices(s, len(store)))
        expected = _softmax_mean([bnn.forward_with({n: t[i] for n, t in draws.items()}, x) for i in range(s)])
        torch.testing.assert_close(bnn.predict(x, s), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(bnn.sample_logits(x, s).softmax(-1).mean(0), expected, rtol=0, atol=1e-6)


def test_sgld_predictive_objects():
    from bayeswrap.methods.predictives import PosteriorMean, Sampled, StoredDraws

    bnn, x = _sgld()
    stored = StoredDraws(lambda b: b.sample_store)
    ensemble = bnn.predict(x, 7)
    torch.testing.assert_close(bnn.predict(x, 7, predictive=stored), ensemble, rtol=0, atol=0)
    bnn.predictive = "gaussian"  # N(running mean, running variance): Sampled over the method's draws
    torch.testing.assert_close(bnn.predict(x, 7, _gen()), bnn.predict(x, 7, _gen(), predictive=Sampled()),
                               rtol=0, atol=0)
    assert not torch.allclose(bnn.predict(x, 7, _gen()), ensemble, atol=1e-4)
    torch.testing.assert_close(bnn.predict(x, 7, predictive=stored), ensemble, rtol=0, atol=0)
    torch.testing.assert_close(bnn.predict(x, 5, predictive=PosteriorMean()), bnn.predict(x, 0), rtol=0, atol=0)


def test_sampled_is_the_chunked_loop_over_draws_naive_loop():
    bnn = bw.wrap(_mlp(), "vi", num_data=64, chunk_size=2).eval()
    x, _ = _data(10)
    g = _gen()
    outs = []
    for count in (2, 2, 1):  # S = 5 in chunks of chunk_size = 2, each drawn from the same generator
        draws = bnn.sample(count, generator=g)
        outs += [bnn.forward_with({n: t[i] for n, t in draws.items()}, x) for i in range(count)]
    torch.testing.assert_close(bnn.predict(x, 5, generator=_gen()), _softmax_mean(outs), rtol=0, atol=1e-6)
    torch.testing.assert_close(bnn.sample_logits(x, 5, generator=_gen()), torch.stack(outs), rtol=0, atol=1e-6)


def test_sampled_and_posterior_mean_objects():
    from bayeswrap.methods.predictives import PosteriorMean, Sampled

    bnn = bw.wrap(_mlp(), "vi", num_data=64, chunk_size=2).eval()
    x, _ = _data(10)
    torch.testing.assert_close(bnn.predict(x, 5, _gen(), predictive=Sampled()), bnn.predict(x, 5, _gen()),
                               rtol=0, atol=0)
    half = Sampled(draw=lambda b, s, g: {n: m.expand(s, *m.shape) for n, m in b.posterior_mean().items()})
    torch.testing.assert_close(bnn.predict(x, 3, predictive=half), bnn.predict(x, 0), rtol=0, atol=1e-6)
    torch.testing.assert_close(bnn.predict(x, 3, predictive=PosteriorMean()), bnn.predict(x, 0), rtol=0, atol=0)
    assert bnn.sample_logits(x, 3, predictive=PosteriorMean()).shape == (1, 10, 3)


def test_median_model_is_the_forward_at_the_mpm_weights_naive_loop():
    bnn = bw.wrap(_mlp(), "lbbnn", num_data=64, local_reparam=False).eval()
    x, _ = _data(10)
    mean = bnn.mpm_mean()
    alpha = bnn.inclusion_probs()
    assert any(bool((a <= 0.5).any()) for a in alpha.values())  # some weights are left out, so the MPM differs
    torch.testing.assert_close(bnn.predict(x, 0, model="mpm"), bnn.forward_with(mean, x).softmax(-1), rtol=0,
                               atol=1e-6)
    # S draws of the MPM: the Gaussian weights of the included ones, from the same generator as the full model's
    g = _gen()
    sigma = {n: torch.nn.functional.softplus(r) for n, r in bnn.rho.items()}
    outs = []
    draws = {}
    for n, m in bnn.mean.items():
        eps = torch.randn((4, *m.shape), generator=g)
        w = m + sigma[n] * eps
        draws[n] = w * (alpha[n] > 0.5).to(w.dtype) if n in alpha else w
    outs = [bnn.forward_with({n: t[i] for n, t in draws.items()}, x) for i in range(4)]
    torch.testing.assert_close(bnn.predict(x, 4, _gen(), model="mpm"), _softmax_mean(outs), rtol=0, atol=1e-6)


def test_median_model_object():
    from bayeswrap.methods.predictives import MedianModel

    bnn = bw.wrap(_mlp(), "lbbnn", num_data=64).eval()
    x, _ = _data(10)
    for s in (0, 3):
        torch.testing.assert_close(bnn.predict(x, s, _gen(), predictive=MedianModel()),
                                   bnn.predict(x, s, _gen(), model="mpm"), rtol=0, atol=0)
    torch.testing.assert_close(bnn.sample_logits(x, 3, _gen(), predictive=MedianModel()),
                               bnn.sample_logits(x, 3, _gen(), model="mpm"), rtol=0, atol=0)


def _swag_bn():
    model = _mlp(batchnorm=True)
    x, y = _data()
    batches = _batches(x, y)
    bnn = bw.wrap(model, "swag", num_data=64, swa_start=2, bn_update_batches=3)
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.1, momentum=0.9)
    bw.fit(bnn, batches, epochs=3, optimizer=opt, progress=False)
    return model, bnn.eval(), x[:10]


def test_swag_batchnorm_refresh_is_a_train_mode_pass_per_draw_naive_loop():
    model, bnn, x = _swag_bn()
    draws = bnn.sample(3, generator=_gen())
    outs = []
    for i in range(3):
        theta = {n: t[i] for n, t in draws.items()}
        net = copy.deepcopy(model)
        net.load_state_dict({**theta, **bnn.bn_statistics(theta)}, strict=False)
        outs.append(net.eval()(x).detach())
    torch.testing.assert_close(bnn.predict(x, 3, generator=_gen()), _softmax_mean(outs), rtol=0, atol=1e-5)


def test_swag_batchnorm_refresh_object():
    from bayeswrap.methods.predictives import Sampled

    _, bnn, x = _swag_bn()
    refresh = Sampled(forward=type(bnn)._forward_bn)
    torch.testing.assert_close(bnn.predict(x, 3, _gen(), predictive=refresh), bnn.predict(x, 3, _gen()),
                               rtol=0, atol=0)
    plain = bnn.predict(x, 3, _gen(), predictive=Sampled())  # the stored statistics: a different predictive
    assert not torch.allclose(plain, bnn.predict(x, 3, _gen()), atol=1e-4)


def test_mc_dropout_layers_predictive_seeds_the_global_rng_from_the_generator_naive_loop():
    bnn = bw.wrap(_mlp(dropout=True), "mc_dropout", num_data=64, mode="layers", chunk_size=1).eval()
    x, _ = _data(10)
    g = _gen()
    seed = int(torch.randint(0, 2**62, (1,), generator=g))
    dropout = [m for m in bnn.model.modules() if isinstance(m, nn.Dropout)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in dropout:
            m.train()
        outs = [bnn.forward_with(bnn.posterior_mean(), x) for _ in range(3)]  # chunks of one draw: no vmap
        for m in dropout:
            m.eval()
    assert not torch.allclose(outs[0], outs[1])
    torch.testing.assert_close(bnn.predict(x, 3, generator=_gen()), _softmax_mean(outs), rtol=0, atol=1e-6)


def test_mc_dropout_layers_object():
    from bayeswrap.methods.predictives import Sampled

    bnn = bw.wrap(_mlp(dropout=True), "mc_dropout", num_data=64, mode="layers").eval()
    x, _ = _data(10)
    active = Sampled(context=type(bnn)._dropout_context)
    torch.testing.assert_close(bnn.predict(x, 4, _gen(), predictive=active), bnn.predict(x, 4, _gen()),
                               rtol=0, atol=0)
    # without the context the dropout modules stay off: every draw is the mean network
    torch.testing.assert_close(bnn.predict(x, 4, _gen(), predictive=Sampled()), bnn.predict(x, 0), rtol=0,
                               atol=1e-6)


def test_ensemble_mixture_is_the_weighted_mixture_of_the_members_naive_loop():
    bnn = bw.wrap(_mlp(), "ensemble", num_data=64, num_members=2, member="vi").eval()
    x, _ = _data(10)
    g = _gen()
    members = [m.predict(x, s, generator=g) for m, s in zip(bnn.members, (3, 2))]
    torch.testing.assert_close(bnn.predict(x, 5, generator=_gen()), 0.6 * members[0] + 0.4 * members[1],
                               rtol=0, atol=1e-6)
    mean = [m.predict(x, 0) for m in bnn.members]
    torch.testing.assert_close(bnn.predict(x, 0), 0.5 * mean[0] + 0.5 * mean[1], rtol=0, atol=1e-6)
    g = _gen()
    logits = torch.cat([m.sample_logits(x, s, generator=g) for m, s in zip(bnn.members, (3, 2))])
    torch.testing.assert_close(bnn.sample_logits(x, 5, generator=_gen()), logits, rtol=0, atol=0)
    maps = bw.wrap(_mlp(), "ensemble", num_data=64, num_members=3).eval()
    torch.testing.assert_close(maps.predict(x, 4), sum(m.predict(x, 0) * w for m, w in zip(maps.members,
                                                                                         (0.5, 0.25, 0.25))),
                               rtol=0, atol=1e-6)


def test_ensemble_mixture_object():
    from bayeswrap.methods.predictives import Mixture

    bnn = bw.wrap(_mlp(), "ensemble", num_data=64, num_members=2, member="vi").eval()
    x, _ = _data(10)
    for s in (0, 5):
        torch.testing.assert_close(bnn.predict(x, s, _gen(), predictive=Mixture()), bnn.predict(x, s, _gen()),
                                   rtol=0, atol=0)


def test_legacy_options_and_predictive_objects_are_checked():
    from bayeswrap.methods.predictives import MedianModel, Sampled

    bnn = bw.wrap(_mlp(), "vi", num_data=64).eval()
    x, _ = _data(4)
    with pytest.raises(ValueError, match=r"model='mpm' is not accepted by method 'vi'; accepted: 'full'"):
        bnn.predict(x, 2, model="mpm")
    with pytest.raises(TypeError, match=r"\['link_approx'\] are not accepted by method 'vi'; accepted: model"):
        bnn.predict(x, 2, link_approx="mc")
    with pytest.raises(TypeError, match=r"predictive='ensemble' is not accepted; accepted: a .*Predictive"):
        bnn.predict(x, 2, predictive="ensemble")
    lbbnn = bw.wrap(_mlp(), "lbbnn", num_data=64).eval()
    with pytest.raises(ValueError, match=r"were both given; accepted: one of them"):
        lbbnn.predict(x, 2, model="mpm", predictive=MedianModel())
    with pytest.raises(ValueError, match=r"model='median' is not accepted by method 'lbbnn'; accepted: 'full', 'mpm'"):
        lbbnn.sample_logits(x, 2, model="median")
    with pytest.raises(ValueError, match=r"num_samples"):  # S is checked before the predictive is used
        bnn.sample_logits(x, 0, predictive=Sampled())
    assert "forward=" in repr(Sampled(forward=type(bnn).forward_with)) and repr(MedianModel()) == "MedianModel()"
