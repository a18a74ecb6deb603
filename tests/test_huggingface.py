"""Hugging Face and multi-input models (issue 24, item 1) and the last layer (item 2).

A tiny ``BertForSequenceClassification`` (random init from a ``BertConfig``) is fed by
a real Hugging Face data collator (``DataCollatorWithPadding`` over a ``BertTokenizer``
built from a vocabulary file the test writes): dict batches with ``labels``, and a
``ModelOutput`` with ``logits``, through ``fit``, ``loss``, ``predict``,
``predict_loader``, ``sample_probs_loader``, ``evaluate``, curvature and every method.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader

import bayeswrap as bw
from bayeswrap.core.batches import batch_pair
from bayeswrap.core.functional import find_last_layer, model_output, select_parameters, vmap_over_examples

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

WORDS = ["good", "bad", "film", "plot", "actor", "scene", "very", "not", "fine", "dull"]


def _bert(dropout: float = 0.0, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                                  num_labels=2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                  initializer_range=0.2, **overrides)
    return transformers.BertForSequenceClassification(cfg).eval()


@pytest.fixture(scope="module")
def hf_loader(tmp_path_factory):
    """A DataLoader of 48 padded sentences: dict batches {input_ids, token_type_ids, attention_mask, labels}."""
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS))
    tokenizer = transformers.BertTokenizer(str(folder / "vocab.txt"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(48):
        n = int(torch.randint(3, 9, (1,), generator=g))
        words = [WORDS[int(j)] for j in torch.randint(2, 10, (n,), generator=g)]
        words[int(torch.randint(0, n, (1,), generator=g))] = "good" if i % 2 else "bad"  # the label's word
        rows.append({**tokenizer(" ".join(words)), "labels": i % 2})
    return DataLoader(rows, batch_size=16, collate_fn=transformers.DataCollatorWithPadding(tokenizer))


def _probs_of(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        return model(**inputs).logits.softmax(-1)


def test_map_without_prior_is_the_plain_huggingface_loop(hf_loader):
    """bw.fit on dict batches and a ModelOutput = the plain loop model(**batch).loss, step for step (AdamW)."""
    model = _bert()
    bnn = bw.wrap(model, "map", num_data=48, prior_std=None)
    bw.fit(bnn, hf_loader, epochs=3, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2), progress=False)
    plain = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for _ in range(3):
        for batch in hf_loader:
            opt.zero_grad()
            plain(**batch).loss.backward()  # Hugging Face's own cross-entropy on batch["labels"]
            opt.step()
    mean = bnn.posterior_mean()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(mean[name], p.detach(), rtol=1e-5, atol=1e-6)
    batch = next(iter(hf_loader))
    torch.testing.assert_close(bnn.predict(batch, num_samples=0), _probs_of(plain.eval(), batch))  # labels dropped
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), _bert().parameters()))  # the model is untouched


@pytest.mark.parametrize("method, options", [
    ("vi", {}), ("mc_dropout", {}), ("swag", {}), ("ensemble", {"num_members": 2}), ("sgld", {"burn_in": 3}),
    ("laplace", {"subset_of_weights": "all"}), ("laplace", {"subset_of_weights": "last_layer",
                                                           "hessian_structure": "kron"}), ("ivon", {}),
    ("sparse_vd", {}), ("kingma_vd", {}), ("lbbnn", {}), ("multiswag", {"num_members": 2})])
def test_every_method_learns_and_predicts_on_huggingface_batches(hf_loader, method, options):
    """Each method trains on the collator's dict batches and its loaders agree with predict; the task is learnt."""
    bnn = bw.wrap(_bert(), method, num_data=48, prior_std=1.0, **options)
    if method == "sgld":
        opt = bw.optim.SGLD(bnn.param_groups(), lr=0.01, num_data=48)
    elif method == "ivon":
        opt = bw.optim.IVON(bnn.param_groups(), lr=0.03, beta2=0.999)
    else:
        opt = torch.optim.AdamW(bnn.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # vmap falls back to a loop over the examples
        bw.fit(bnn, hf_loader, epochs=10 if method in ("sgld", "ivon") else 6, optimizer=opt, progress=False)
        probs, labels = bw.predict_loader(bnn, hf_loader, num_samples=4, generator=torch.Generator().manual_seed(1))
        samples, _ = bw.sample_probs_loader(bnn, hf_loader, num_samples=4, generator=torch.Generator().manual_seed(1))
        scores = bw.evaluate(bnn, hf_loader, num_samples=4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(labels, torch.cat([b["labels"] for b in hf_loader]))
    assert probs.shape == (48, 2) and samples.shape == (4, 48, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(48, dtype=probs.dtype))
    nll = -probs.gather(1, labels[:, None]).log().mean().item()
    assert scores["nll"] == pytest.approx(nll, rel=1e-5)  # evaluate scores the loader's predictive
    assert scores["error"] == pytest.approx((probs.argmax(-1) != labels).float().mean().item())
    # SGLD and IVON sample a broad posterior at N = 48 (prior std 1), and the variational dropouts' multiplicative
    # noise needs more than 18 steps on 48 sentences: their error is not held to the bar
    if method not in ("sgld", "ivon", "sparse_vd", "kingma_vd"):
        assert scores["error"] <= 0.2  # the label's word decides the class: the task is learnt


def test_full_network_laplace_on_bert_matches_a_reference_loop(hf_loader):
    """Diagonal GGN of the whole BERT (vmap falls back to a loop) = Σ_n diag(J_nᵀ Λ_n J_n) from per-example jacrev."""
    model = _bert()
    batch = next(iter(hf_loader))
    x, _ = batch_pair(batch)
    x = {k: v[:4] for k, v in x.items()}
    reference = {}
    params = {n: p.detach() for n, p in model.named_parameters()}
    for i in range(4):
        x1 = {k: v[i:i + 1] for k, v in x.items()}
        f = model(**x1).logits.detach()[0]
        p = f.softmax(-1)
        lam = torch.diag(p) - torch.outer(p, p)
        jac = jacrev(lambda th: functional_call(model, th, (), x1).logits[0])(params)
        for n, j in jac.items():
            j = j.reshape(2, -1)
            reference[n] = reference.get(n, 0) + torch.einsum("ki,kl,li->i", j, lam, j).reshape(params[n].shape)
    for backend in ("layers", "vmap"):
        bnn = bw.wrap(model, "laplace", num_data=48, curvature_backend=backend)
        assert bnn.subset_of_weights == "all"  # a small model: the whole network by default
        with pytest.warns(RuntimeWarning, match="loops instead"):
            diag = bnn.ggn_diagonal(x)
        for n in reference:
            torch.testing.assert_close(diag[n], reference[n], rtol=1e-4, atol=1e-7)


class _Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(3, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM, nn.RNN])
def test_full_network_laplace_on_recurrent_models(cell):
    """GRU, LSTM and RNN: the diagonal GGN of both backends = a per-example jacrev loop; kron and full fit."""
    torch.manual_seed(0)
    model = _Recurrent(cell)
    x, y = torch.randn(6, 4, 3), torch.randint(0, 3, (6,))
    params = {n: p.detach() for n, p in model.named_parameters()}
    reference = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(6):
        p = model(x[i:i + 1]).detach()[0].softmax(-1)
        lam = torch.diag(p) - torch.outer(p, p)
        jac = jacrev(lambda th: functional_call(model, th, (x[i:i + 1],))[0])(params)
        for n, j in jac.items():
            j = j.reshape(3, -1)
            reference[n] += torch.einsum("ki,kl,li->i", j, lam, j).reshape(params[n].shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for backend in ("layers", "vmap"):
            diag = bw.wrap(model, "laplace", num_data=6, curvature_backend=backend).ggn_diagonal(x)
            for n in reference:
                torch.testing.assert_close(diag[n], reference[n], rtol=1e-4, atol=1e-7)
        for structure in ("kron", "full"):
            bnn = bw.wrap(model, "laplace", num_data=6, hessian_structure=structure)
            bnn.fit_curvature([(x, y)])
            probs = bnn.predict(x, num_samples=0)
            assert probs.shape == (6, 3) and torch.isfinite(probs).all()


def test_vmap_over_examples_loop_equals_vmap():
    """The fallback loop returns what vmap returns (in_dims with None, nested outputs)."""
    w = torch.randn(3, 4)
    xs = torch.randn(5, 4)

    def fn(weight, x1):
        return {"a": weight @ x1, "b": (x1.sum(), x1 * 2)}

    def branching(weight, x1):  # data-dependent control flow: vmap refuses it
        return fn(weight, x1) if bool(x1.sum() > -100) else fn(-weight, x1)

    expected = torch.func.vmap(fn, in_dims=(None, 0))(w, xs)
    with pytest.warns(RuntimeWarning, match="loops instead"):
        got = vmap_over_examples(branching, in_dims=(None, 0))(w, xs)
    torch.testing.assert_close(got["a"], expected["a"])
    torch.testing.assert_close(got["b"][0], expected["b"][0])
    torch.testing.assert_close(got["b"][1], expected["b"][1])
    with pytest.raises(ValueError, match="own error"):  # an error of fn itself is raised as it is
        vmap_over_examples(lambda x1: (_ for _ in ()).throw(ValueError("own error")))(xs)


class _TupleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, a, b):
        h = torch.tanh(self.body(a + b))
        return self.head(h), h  # (logits, features): the first element is used


class _DictModel(_TupleModel):
    def forward(self, a, b):
        logits, h = super().forward(a, b)
        return {"features": h, "out": logits}


def test_tuple_and_dict_outputs_and_keyword_batches():
    """Tuple outputs use element 0; mapping outputs use output_key; mapping batches use label_key."""
    torch.manual_seed(0)
    a, b, y = torch.randn(20, 4), torch.randn(20, 4), torch.randint(0, 3, (20,))
    loader = [{"a": a[i:i + 5], "b": b[i:i + 5], "target": y[i:i + 5]} for i in range(0, 20, 5)]
    tup = _TupleModel()
    dic = _DictModel()
    dic.load_state_dict(tup.state_dict())
    results = []
    for model, kwargs in ((tup, {}), (dic, {"output_key": "out"})):
        bnn = bw.wrap(model, "map", num_data=20, prior_std=1.0, label_key="target", **kwargs)
        bw.fit(bnn, loader, epochs=3, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1, momentum=0.9),
               progress=False)
        results.append(bnn.predict({"a": a, "b": b, "target": y}, num_samples=0))
    torch.testing.assert_close(results[0], results[1])
    expected = tup.head(torch.tanh(tup.body(a + b))).softmax(-1)  # untouched model: the fit changed results
    assert not torch.allclose(results[0], expected)
    with pytest.raises(TypeError, match=r"keys \['features', 'out'\] and no tensor under output_key='logits'"):
        bw.wrap(dic, "map", num_data=20, label_key="target").predict({"a": a, "b": b}, num_samples=0)
    bnn = bw.wrap(tup, "map", num_data=20)
    with pytest.raises(ValueError, match=r"keys \['a', 'b', 'target'\] and no key 'labels'.*label_key="):
        bw.fit(bnn, loader, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False)
    with pytest.raises(ValueError, match="label_key=3 is not accepted"):
        bw.wrap(tup, "map", num_data=20, label_key=3)


def test_model_output_reads_every_return_type():
    t = torch.randn(2, 3)
    out = transformers.modeling_outputs.SequenceClassifierOutput(logits=t)
    assert model_output(out) is t and model_output({"logits": t}) is t and model_output((t, t + 1)) is t
    assert model_output(t) is t
    with pytest.raises(TypeError, match="accepted: a tensor of outputs"):
        model_output("text")


# ---------------------------------------------------------------------- the last layer (item 2)
def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=20, n_positions=16, n_embd=8, n_layer=1, n_head=2, num_labels=3,
                                  pad_token_id=0)
    return transformers.GPT2ForSequenceClassification(cfg)


@pytest.mark.parametrize("build, expected", [
    (lambda: __import__("timm").create_model("resnet18", num_classes=4), ["fc.weight", "fc.bias"]),
    (lambda: __import__("timm").create_model("vit_tiny_patch16_224", num_classes=4), ["head.weight", "head.bias"]),
    (lambda: __import__("timm").create_model("convnext_atto", num_classes=4), ["head.fc.weight", "head.fc.bias"]),
    (lambda: __import__("torchvision").models.resnet18(num_classes=4), ["fc.weight", "fc.bias"]),
    (lambda: __import__("torchvision").models.efficientnet_b0(num_classes=4),
     ["classifier.1.weight", "classifier.1.bias"]),
    (lambda: _bert(), ["classifier.weight", "classifier.bias"]),
    (_gpt2, ["score.weight"]),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Softmax(-1)), ["2.weight", "2.bias"]),
])
def test_params_last_layer_finds_the_classifier(build, expected):
    model = build()
    assert select_parameters(model, "last_layer") == expected
    assert bw.wrap(model, "vi", num_data=10, params="last_layer").bayesian_names == expected


def test_laplace_defaults_to_the_last_layer_above_a_parameter_count():
    import timm

    from bayeswrap.methods.laplace.laplace import AUTO_LAST_LAYER_ABOVE

    big = timm.create_model("resnet18", num_classes=4)  # 11.2 M trainable parameters
    assert sum(p.numel() for p in big.parameters()) > AUTO_LAST_LAYER_ABOVE
    bnn = bw.wrap(big, "laplace", num_data=10)
    assert bnn.subset_of_weights == "last_layer" and bnn.bayesian_names == ["fc.weight", "fc.bias"]
    assert bw.wrap(big, "laplace", num_data=10, params=["layer4.*"]).subset_of_weights == "all"
    assert bw.wrap(big, "laplace", num_data=10, params="last_layer").last_layer_name == "fc"
    small = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert bw.wrap(small, "laplace", num_data=10).subset_of_weights == "all"
    with pytest.raises(ValueError, match="contradict"):
        bw.wrap(small, "laplace", num_data=10, params="last_layer", subset_of_weights="all")


def test_a_pattern_that_matches_nothing_names_the_classifier():
    import timm

    model = timm.create_model("resnet18", num_classes=4)
    with pytest.raises(ValueError, match=r"'head\.\*' matches no trainable parameter.*the classifier is "
                                         r"\['fc\.weight', 'fc\.bias'\] \(params='last_layer' or \['fc\.\*'\]"):
        bw.wrap(model, "vi", num_data=10, params=["head.*"])
    assert find_last_layer(model) == "fc"
