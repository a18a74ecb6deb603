"""TFB (Shi et al. 2024): a low-rank isotropic Gaussian on LoRA's A, its σ found by a post hoc search.

Oracles: the closed form of a Gaussian-likelihood LoRA regression's anchor NLL as a function of σ (a quadratic
with one draw), which the bisection must bracket to its tolerance; the covariance of B (A_s − A), which must be
σ² U Uᵀ (isotropic in B's column space, TFB's family) with the marginal stds of :meth:`posterior_std`; MAP trained
alike (σ = 0 and the posterior mean are the MAP LoRA); the isotropic full-rank case; and the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.methods.base import NotFittedError

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")


def _lora(seed: int = 0, n_in: int = 5, n_out: int = 2, r: int = 2, init: bool = False) -> nn.Module:
    """One Linear(n_in, n_out) with LoRA (rank r, α = 2r: scaling 2); random A and B unless ``init``."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], init_lora_weights=init)
    return peft.get_peft_model(nn.Sequential(nn.Linear(n_in, n_out)), config)


def _regression_data(seed: int = 1, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = x @ torch.randn(5, 2, generator=g) + 0.3 * torch.randn(n, 2, generator=g)
    return x, y


def test_the_search_brackets_the_closed_form_sigma_to_its_tolerance():
    model, (x, y) = _lora(), _regression_data()
    options = dict(params="adapters_A", num_data=64, likelihood="gaussian", noise_std=0.5, search_samples=1)
    eps, steps, sigma_range = 0.05, 14, (1e-4, 10.0)
    bnn = bw.wrap(model, "tfb", epsilon=eps, search_steps=steps, sigma_range=sigma_range, **options)
    chosen = bnn.search_sigma([(x, y)])
    # the one draw the search makes at every σ (search_seed=0): A + σ M E, so the outputs are f₀ + σ g
    unit = bw.wrap(model, "tfb", sigma=1.0, **options)
    draw = unit.sample(1, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        f0 = unit.forward_with(unit.posterior_mean(), x).double()
        g = unit.forward_with({n: t[0] for n, t in draw.items()}, x).double() - f0
    r, s2, n = y.double() - f0, 0.25, len(x)
    # NLL(σ) = Σ (r − σ g)² / (2 s² N) + D/2 log(2π s²) (S = 1: the predictive's variance is the noise's)
    nll0 = float(r.square().sum() / (2 * s2 * n) + math.log(2 * math.pi * s2))
    a, b = float(-(r * g).sum() / (s2 * n)), float(g.square().sum() / (2 * s2 * n))
    closed = (-a + math.sqrt(a * a + 4 * b * eps * abs(nll0))) / (2 * b)  # a σ + b σ² = ε |NLL(0)|
    record = bnn.search_record
    assert record["bound_hit"] is None and record["chosen"] == chosen == bnn.sigma
    assert record["baseline"] == pytest.approx(nll0, rel=1e-6)
    for sigma, value in zip(record["sigma"], record["metric"]):  # every σ scored is the closed form's
        assert value == pytest.approx(nll0 + a * sigma + b * sigma**2, rel=1e-5), sigma
    above = min(s for s, ok in zip(record["sigma"], record["within"]) if not ok)
    assert chosen <= closed <= above  # bracketed
    ratio = (sigma_range[1] / sigma_range[0]) ** (1 / 2**steps)
    assert above / chosen == pytest.approx(ratio, rel=1e-9)  # to the bisection's tolerance (0.06 % here)
    assert len(record["sigma"]) == steps + 2


def test_draws_are_isotropic_in_bs_column_space_and_match_the_marginal_stds():
    """B (A_s − A) = σ U E: its covariance over draws and columns is σ² U Uᵀ, whatever V (TFB's §3 family)."""
    model = _lora(seed=3, n_in=6, n_out=5, r=3)
    sigma = 0.2
    bnn = bw.wrap(model, "tfb", params="adapters_A", num_data=10, sigma=sigma)
    (name, mean), = bnn.posterior_mean().items()
    b = bnn.point[name.replace("lora_A", "lora_B")].detach().double()
    draws = bnn.sample(20000, generator=torch.Generator().manual_seed(0))[name].double()
    noise = torch.einsum("oi,sij->soj", b, draws - mean.double()) / sigma  # (S, out, in)
    cols = noise.permute(0, 2, 1).reshape(-1, b.shape[0])
    u = torch.linalg.svd(b, full_matrices=False)[0]
    torch.testing.assert_close(cols.T @ cols / len(cols), u @ u.T, rtol=0, atol=0.02)
    torch.testing.assert_close(draws.std(0), bnn.posterior_std()[name].double(), rtol=0.03, atol=0)
    # the marginal std of A's row i: σ (Σ_k V_ik² / d_k²)^½
    _, d, vh = torch.linalg.svd(b, full_matrices=False)
    expected = sigma * (vh.T.square() / d.square()).sum(1).sqrt()
    torch.testing.assert_close(bnn.posterior_std()[name][:, 0].double(), expected, rtol=1e-5, atol=0)


def test_sigma_zero_and_the_posterior_mean_are_the_map_lora():
    x = torch.randn(48, 5, generator=torch.Generator().manual_seed(2))
    y = (x[:, 0] > 0).long()
    loader = [(x[:24], y[:24]), (x[24:], y[24:])]

    def trained(method, **options):
        bnn = bw.wrap(_lora(init=True), method, params="adapters_A", num_data=48, **options)
        torch.manual_seed(0)
        bw.fit(bnn, loader, epochs=4, optimizer=torch.optim.AdamW(bnn.param_groups(), lr=5e-2), progress=False)
        return bnn

    map_, fixed, searched = trained("map"), trained("tfb", sigma=0.0), trained("tfb")
    expected = map_.predict(x, 0)
    for bnn in (fixed, searched):
        torch.testing.assert_close(bnn.predict(x, 0), expected, rtol=0, atol=0)
    torch.testing.assert_close(fixed.predict(x, 4, generator=torch.Generator().manual_seed(1)), expected,
                               rtol=0, atol=1e-7)
    assert searched.sigma > 0 and not torch.allclose(searched.predict(x, 4), expected)
    with torch.no_grad():
        torch.testing.assert_close(searched.to_deterministic()(x).softmax(-1), expected, rtol=0, atol=1e-6)
    # a state_dict round trip keeps σ and the predictions
    fresh = bw.wrap(_lora(init=True), "tfb", params="adapters_A", num_data=48)
    fresh.load_state_dict(searched.state_dict())
    assert fresh.is_ready() and fresh.sigma == searched.sigma
    torch.testing.assert_close(fresh.predict(x, 3, generator=torch.Generator().manual_seed(4)),
                               searched.predict(x, 3, generator=torch.Generator().manual_seed(4)), rtol=0, atol=0)


def test_predicted_labels_hold_the_share_of_unchanged_predictions():
    """``labels="predicted"``, ``metric="accuracy"`` (the authors' accuracy variant): the share of anchor
    predictions the noise leaves as the trained LoRA's, at least 1 − ε at the chosen σ and below it just above.
    """
    model = _lora(seed=2, n_out=3)
    x = torch.randn(200, 5, generator=torch.Generator().manual_seed(3))
    loader = [(x[:100], torch.zeros(100, dtype=torch.long)), (x[100:], torch.zeros(100, dtype=torch.long))]
    bnn = bw.wrap(model, "tfb", params="adapters_A", num_data=200, metric="accuracy", labels="predicted",
                  epsilon=0.1, search_samples=3, sigma_range=(1e-3, 1e3))
    chosen = bnn.search_sigma(loader)
    record = bnn.search_record
    assert record["baseline"] == 1.0 and record["bound_hit"] is None  # the trained LoRA agrees with itself
    generator = torch.Generator().manual_seed(0)  # a naive loop: the search's draws at the chosen σ
    agree = [(bnn.predict(xb, 3, generator=generator).argmax(1) == bnn.predict(xb, 0).argmax(1)).float()
             for xb, _ in loader]
    share = float(torch.cat(agree).mean())
    assert share == pytest.approx(record["metric"][record["sigma"].index(chosen)], rel=1e-6) and share >= 0.9
    above = min(s for s, ok in zip(record["sigma"], record["within"]) if not ok)
    assert record["metric"][record["sigma"].index(above)] < 0.9


def test_a_model_without_lora_gets_the_isotropic_full_rank_case():
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Linear(3, 2), "tfb", num_data=4, sigma=0.3)
    assert all(torch.equal(s, torch.full_like(s, 0.3)) for s in bnn.posterior_std().values())
    draws = bnn.sample(20000, generator=torch.Generator().manual_seed(0))
    for name, mean in bnn.posterior_mean().items():
        torch.testing.assert_close(draws[name].std(0), torch.full_like(mean, 0.3), rtol=0.03, atol=0)


def test_refusals_name_the_value_and_the_accepted_ones():
    model = _lora()
    with pytest.raises(ValueError, match=r"params selects LoRA's B factors \(\['base_model.model.0.lora_B.default.weight'\]\).*accepted: params='adapters_A'"):
        bw.wrap(model, "tfb", params="adapters", num_data=8)
    with pytest.raises(ValueError, match=r"params='adapters_A': no peft adapter parameter was found in the Sequential"):
        bw.wrap(nn.Sequential(nn.Linear(3, 2)), "tfb", params="adapters_A", num_data=8)
    with pytest.raises(ValueError, match=r"every LoRA B factor is zero .*accepted: a trained LoRA"):
        bw.wrap(_lora(init=True), "tfb", params="adapters_A", num_data=8).search_sigma([(torch.randn(4, 5),
                                                                                         torch.randint(0, 2, (4,)))])
    with pytest.raises(ValueError, match=r"metric='accuracy' needs class or token probabilities, but "
                                         r"likelihood='gaussian'"):
        bw.wrap(model, "tfb", params="adapters_A", num_data=8, likelihood="gaussian", metric="accuracy")
    with pytest.raises(ValueError, match=r"labels='predicted' needs class or token probabilities, but "
                                         r"likelihood='gaussian'; accepted: labels='data'"):
        bw.wrap(model, "tfb", params="adapters_A", num_data=8, likelihood="gaussian", labels="predicted")
    for bad in [(1.0, 0.1), (0.0, 1.0), (1e-3,), "wide"]:
        with pytest.raises(ValueError, match=r"sigma_range=.* is not accepted; accepted: \(low, high\)"):
            bw.wrap(model, "tfb", params="adapters_A", num_data=8, sigma_range=bad)
    with pytest.raises(ValueError, match=r"metric='ece' is not known"):
        bw.wrap(model, "tfb", params="adapters_A", num_data=8, metric="ece")
    with pytest.raises(ValueError, match=r"epsilon=0 must be a number"):
        bw.wrap(model, "tfb", params="adapters_A", num_data=8, epsilon=0)
    bnn = bw.wrap(model, "tfb", params="adapters_A", num_data=8)
    with pytest.raises(NotFittedError, match=r"the TFB posterior has no σ yet: call bnn.search_sigma"):
        bnn.predict(torch.randn(2, 5), 2)
    with pytest.raises(ValueError, match=r"anchor_loader"):
        bnn.search_sigma(iter([(torch.randn(2, 5), torch.randint(0, 2, (2,)))]))


def test_a_tiny_bert_lora_with_dict_batches_is_bayesianized_after_fit():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    model = peft.get_peft_model(transformers.BertForSequenceClassification(cfg), config)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 40, (8, 6), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones(8, 6, dtype=torch.long),
                        "labels": (ids[:, 0] < 20).long()})
    bnn = bw.wrap(model, "tfb", params="adapters_A", num_data=24, epsilon=0.01, search_samples=4,
                  sigma_range=(1e-4, 1e4))
    assert all(".lora_A." in n for n in bnn.bayesian_names) and len(bnn.bayesian_names) == 2
    bw.fit(bnn, batches, epochs=10, optimizer=torch.optim.AdamW(bnn.param_groups(), lr=3e-2), progress=False)
    record = bnn.search_record
    assert bnn.sigma == record["chosen"] > 0 and record["bound_hit"] is None
    # a naive loop over the anchor batches: the NLL of the 4-draw predictive, the generator seeded once per σ
    generator = torch.Generator().manual_seed(0)
    nlls = []
    for batch in batches:
        x = {k: v for k, v in batch.items() if k != "labels"}
        probs = bnn.predict(x, 4, generator=generator)
        nlls.append(-probs.gather(1, batch["labels"][:, None]).clamp_min(1e-12).log())
    naive = float(torch.cat(nlls).mean())
    chosen = record["metric"][record["sigma"].index(bnn.sigma)]
    assert chosen == pytest.approx(naive, rel=1e-5) and chosen - record["baseline"] <= 0.01 * record["baseline"]
    above = min(s for s, ok in zip(record["sigma"], record["within"]) if not ok)
    assert above > bnn.sigma and (bnn.posterior_std()[bnn.bayesian_names[0]] > 0).all()
