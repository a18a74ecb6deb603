"""MC-dropout: dropout on the parameters towards the prior mean (BayesDLL §2.2), or the model's own dropout layers.

``mode="params"`` (the default) drops parameters. Each parameter is kept with
probability 1 − p or reset to its prior mean: θ = z ⊙ m + (1 − z) ⊙ θ̄ with
z ~ Bernoulli(1 − p), i.e. q(θ_i) is the spiky mixture (1 − p) δ(m_i) + p δ(θ̄_i).
The loss is BayesDLL's eq. 10:

    L(m) = NLL(y | x, θ) + kl_weight · Σ_i (1 − p_i) (m_i − θ̄_i)² / (2 σ² N).

``mode="layers"`` is the standard MC dropout of Gal & Ghahramani 2016 (what
torch-uncertainty's ``MCDropout`` does): the model's own dropout modules
(:data:`DROPOUT_LAYERS`: ``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``,
``FeatureAlphaDropout``) drop units. Training is MAP with those modules active
(the wrapped model is in train mode while ``bw.fit`` runs):

    L(M) = NLL(y | x, M, z) + kl_weight · Σ_i (M_i − θ̄_i)² / (2 σ² N),    z ~ Bernoulli(1 − p) per unit,

the prior term exactly as :class:`~bayeswrap.MAP` computes it (Gal & Ghahramani's
eq. 4 up to the weight-decay constant). In the predictive every dropout module of
the storage-free copy is switched to train mode while the rest of the network (BatchNorm,
...) stays in eval mode, and each of the S forward passes draws its own masks:
p(y | x, D) ≈ (1/S) Σ_s softmax(f(x; M, z_s)) (their eq. 8). PyTorch's dropout is
inverted (kept units are scaled by 1/(1 − p)), so E_z[W diag(z)/(1 − p)] = W: the
parameters M are the posterior mean, and ``predict(x, num_samples=0)`` is the
network with its dropout off (the weight-scaling rule). The weights themselves are a
point estimate (``posterior_std`` is 0 and :meth:`MCDropout.sample` repeats M); the
spread lives in the masks, which :meth:`~bayeswrap.BayesianModel.sample_logits` and
``predict`` draw. Stochastic-depth modules (timm's ``DropPath``) and dropout called
as a function inside a module's ``forward`` (``F.dropout(x, training=self.training)``)
are not units of a dropout layer and stay off. MC-BatchNorm is not implemented.

On a peft LoRA model whose Bayesian parameters are its adapters (``params="adapters"`` or ``"adapters_A"``, or
any selection made only of adapter tensors), the dropout kept active is LoRA's own: each LoRA layer computes
B A (z ⊙ x) / (1 − p) · scaling with its ``lora_dropout`` module (peft's ``LoraConfig(lora_dropout=p)``), which is
Gal & Ghahramani's Bernoulli dropout of the columns of A, the Bayesian part. Dropout modules of the frozen base
(a transformer's attention or hidden dropout) are not part of that posterior: they follow the model's mode as any
other module does (active while :func:`bayeswrap.fit` trains, as in peft's own fine-tuning; off in ``predict``,
which runs in eval mode), with the probabilities the user set. ``layer_p`` sets the LoRA dropout probability on
bayeswrap's copy only, replacing peft's ``nn.Identity`` (``lora_dropout=0``) by ``nn.Dropout(layer_p)`` there;
a LoRA with ``lora_dropout=0`` and no ``layer_p`` is refused. With other ``params`` (e.g. ``None``, which also makes
a ``modules_to_save`` head Bayesian) every dropout module of the model is kept active, as for any other model.

Reference: Gal & Ghahramani 2016, "Dropout as a Bayesian Approximation:
Representing Model Uncertainty in Deep Learning", ICML (eqs. 4 and 8).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from bayeswrap.core import fused
from bayeswrap.core.adapters import adapter_parameter_names
from bayeswrap.core.batches import x_device
from bayeswrap.core.checks import check_bool
from bayeswrap.core.functional import NamedTensors, is_bias
from bayeswrap.core.fused import dropout_keep_masks, dropout_sample, penalised
from bayeswrap.methods.base import BayesianModel, check_float, check_int, register_method
from bayeswrap.methods.predictives import Predictive, Sampled

BIAS_OPTIONS = ("informative", "uninformative", "gaussian", "spikymix", "ignore")
#: accepted values of ``mode``
MODES = ("params", "layers")
#: the modules that ``mode="layers"`` keeps active in the predictive (torch's dropout modules)
DROPOUT_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
#: the attribute of a peft LoRA layer that holds its dropout modules, one per adapter (``nn.Identity`` for p = 0)
LORA_DROPOUT = "lora_dropout"


@register_method("mc_dropout", order=40)
class MCDropout(BayesianModel):
    """Parameter dropout towards θ̄ (BayesDLL eq. 10), or the model's own dropout layers kept on in the predictive
    (``mode="layers"``; Gal & Ghahramani 2016).

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        p_drop: probability p ∈ [0, 1) that a parameter is reset to its prior
            mean in a sample (BayesDLL default 0.1); unused with ``mode="layers"``.
        bias: how ``*.bias`` parameters are treated:
            ``"informative"`` / ``"spikymix"``: like weights (dropout and the
            (1 − p)-scaled prior term);
            ``"gaussian"``: no dropout (p_b = 0), full Gaussian prior term
            (the original MC-dropout);
            ``"uninformative"``: dropout, but no prior term (p(θ_b) ∝ 1);
            ``"ignore"``: neither dropout nor prior term.
            With ``mode="layers"`` only the prior term applies: full for
            ``"informative"``, ``"spikymix"`` and ``"gaussian"``, none for the others.
        num_train_samples: dropout masks per training step (≥ 1).
        fused: draw the training sample and the prior term with the fused
            bucketed kernel and closed-form gradients
            (:func:`bayeswrap.core.fused.dropout_sample`); False uses the plain
            autograd reference. Same values and gradients.
        mode: ``"params"`` (dropout on the parameters towards θ̄, BayesDLL's eq. 10)
            or ``"layers"`` (standard MC dropout: the model's own dropout modules stay
            active in the predictive, Gal & Ghahramani 2016; the model needs one).
        layer_p: with ``mode="layers"``, the dropout probability in (0, 1) set on every
            dropout module of bayeswrap's copy of the model (never on the model itself);
            None keeps each module's own p. On a LoRA model with adapter ``params``: the
            probability of LoRA's dropout (``lora_dropout``, also where peft left it an
            ``nn.Identity`` for ``lora_dropout=0``), the base's dropout untouched.

    Raises:
        ValueError: if ``p_drop`` is not a number in [0, 1), ``num_train_samples`` not an
            integer ≥ 1, ``bias`` or ``mode`` unknown, ``layer_p`` not None or a number in
            (0, 1) or given with ``mode="params"``; with ``mode="layers"``: a model without
            dropout modules, one whose dropout modules all have p = 0 (and no ``layer_p``),
            a LoRA model with adapter ``params`` whose ``lora_dropout`` is 0 (and no ``layer_p``),
            or one that could not be copied.

    Attributes:
        theta: the kept values m (``mode="layers"``: the weights M), ``{name: Parameter}``.
        dropout_layers: ``mode="layers"``: the names of the dropout modules kept active in
            the predictive (LoRA's ``lora_dropout`` modules on a LoRA model with adapter ``params``;
            empty for ``mode="params"``).
    """

    bias_options = BIAS_OPTIONS
    tuning = ("p_drop", (0.02, 0.05, 0.1, 0.2, 0.3))  # the dropout rate sets the posterior spread
    in_default_comparison = True

    def __init__(self, model, *, p_drop: float = 0.1, num_train_samples: int = 1, fused: bool = True,
                 mode: str = "params", layer_p: float | None = None, **kwargs):
        self.fused = check_bool("fused", fused)
        self.p_drop = check_float("p_drop", p_drop, low=0.0, high=1.0, high_open=True,
                                  note="the probability that a parameter is reset to its prior mean")
        self.num_train_samples = check_int("num_train_samples", num_train_samples, minimum=1)
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"mode={mode!r} is not known; accepted: 'params' (dropout on the parameters towards "
                             "the prior mean) or 'layers' (the model's own dropout modules, standard MC dropout)")
        self.mode = mode
        self.layer_p = check_float("layer_p", layer_p, low=0.0, high=1.0, low_open=True, high_open=True,
                                   allow_none=True, note="the dropout probability of the model's dropout modules")
        if self.layer_p is not None and mode != "layers":
            raise ValueError(f"layer_p={self.layer_p!r} is only used with mode='layers'; accepted: layer_p=None "
                             "with mode='params' (whose rate is p_drop), or mode='layers'")
        super().__init__(model, **kwargs)
        self._dropout_modules = self._find_dropout_layers(model) if mode == "layers" else {}

    def _find_dropout_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """The dropout modules of the storage-free copy, with ``layer_p`` set on them (the copy only)."""
        accepted = ", ".join(f"nn.{cls.__name__}" for cls in DROPOUT_LAYERS)
        if self.model is model:
            raise ValueError(f"mode='layers' switches the dropout modules of bayeswrap's copy of the model, but "
                             f"{type(model).__name__} could not be deep-copied; accepted: a model that "
                             "copy.deepcopy can copy, or mode='params'")
        if self._adapters_only(model):
            return self._lora_dropout_layers(model)
        layers = {name: m for name, m in self.model.named_modules() if isinstance(m, DROPOUT_LAYERS)}
        if not layers:
            raise ValueError(f"mode='layers' keeps the model's own dropout modules active, but "
                             f"{type(model).__name__} has none; accepted: a model with {accepted} modules, or "
                             "mode='params' (dropout on the parameters, which needs no dropout module)")
        if self.layer_p is not None:
            for m in layers.values():
                m.p = self.layer_p
        if all(m.p == 0 for m in layers.values()):
            raise ValueError(f"mode='layers': every dropout module of the model has p=0 ({list(layers)[:4]}), so "
                             "the samples would all be equal; accepted: layer_p in (0, 1) (e.g. layer_p=0.1), or "
                             "a model whose dropout modules have p > 0")
        return layers

    def _adapters_only(self, model: nn.Module) -> bool:
        """Whether the model has LoRA dropout holders and every Bayesian parameter is a peft adapter tensor."""
        if not any(isinstance(getattr(m, LORA_DROPOUT, None), nn.ModuleDict) for m in model.modules()):
            return False
        return set(self.bayesian_names) <= set(adapter_parameter_names(model))

    def _lora_dropout_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """LoRA's dropout modules of the copy (``layer_p`` set on them, an ``nn.Identity`` made a dropout)."""
        layers = {}
        for mod_name, mod in self.model.named_modules():
            holder = getattr(mod, LORA_DROPOUT, None)
            if not isinstance(holder, nn.ModuleDict):
                continue
            for key in list(holder.keys()):
                if self.layer_p is not None:
                    if isinstance(holder[key], DROPOUT_LAYERS):
                        holder[key].p = self.layer_p
                    elif isinstance(holder[key], nn.Identity):  # peft's lora_dropout=0: a dropout on the copy only
                        holder[key] = nn.Dropout(self.layer_p).train(holder[key].training)
                if isinstance(holder[key], DROPOUT_LAYERS) and holder[key].p > 0:
                    layers[f"{mod_name}.{LORA_DROPOUT}.{key}" if mod_name else f"{LORA_DROPOUT}.{key}"] = holder[key]
        if not layers:
            raise ValueError(f"mode='layers' with params selecting the adapters keeps LoRA's own dropout active in "
                             f"the predictive, but every LoRA layer of the {type(model).__name__} has lora_dropout=0 "
                             "(peft's nn.Identity), so the samples would all be equal; accepted: adapters built with "
                             "peft.LoraConfig(lora_dropout=0.1), or layer_p in (0, 1) (e.g. layer_p=0.1, set on "
                             "bayeswrap's copy only)")
        return layers

    @property
    def dropout_layers(self) -> list[str]:
        """Names of the dropout modules kept active in the predictive (``mode="layers"``)."""
        return list(self._dropout_modules)

    def _prior_bias(self, bias):
        return "uninformative" if bias in ("uninformative", "ignore") else "informative"

    def _init_posterior(self, init):
        self.theta = NamedTensors(init, trainable=True)
        no_drop_bias = self.bias in ("gaussian", "ignore")
        # mode="layers": no parameter is dropped, so the prior term, mean, std and samples are MAP's
        p = self.p_drop if self.mode == "params" else 0.0
        self.drop_prob = {n: 0.0 if (no_drop_bias and is_bias(n)) else p for n in init}

    def _masked(self, shape_prefix=(), generator=None):
        out = {}
        dropped = [n for n in self.theta.keys() if self.drop_prob[n] > 0.0]
        # a training sample draws its masks exactly as the fused kernel does (bayeswrap.core.fused.dropout_keep_masks)
        keep = dict(zip(dropped, dropout_keep_masks([self.theta[n] for n in dropped],
                                                    [self.drop_prob[n] for n in dropped], generator))) \
            if not shape_prefix and dropped else {}
        for n, m in self.theta.items():
            p = self.drop_prob[n]
            if p == 0.0:
                out[n] = m.expand(*shape_prefix, *m.shape) if shape_prefix else m
                continue
            mask = keep[n] if n in keep else \
                torch.rand((*shape_prefix, *m.shape), device=m.device, generator=generator) >= p
            out[n] = torch.where(mask, m, self.prior.mean[n])
        return out

    def _train_sample(self):
        return self._masked()

    def _sample_and_regularizer(self):
        if not self.fused or not fused.available():
            return super()._sample_and_regularizer()
        names = self.theta.keys()
        dropped = [n for n in names if self.drop_prob[n] > 0.0]
        kept = [n for n in names if self.drop_prob[n] == 0.0]
        sample, penalty = {}, None
        if dropped:
            scales = [(1.0 - self.drop_prob[n]) * 0.5 / self.prior_std**2 if self.prior.applies_to(n) else 0.0
                      for n in dropped]
            theta, penalty = dropout_sample([self.theta[n] for n in dropped],
                                            [self.drop_prob[n] for n in dropped],
                                            [self.prior.mean[n] for n in dropped], scales)
            sample.update(zip(dropped, theta))
        sample.update({n: self.theta[n] for n in kept})
        with_prior = [n for n in kept if self.prior.applies_to(n)]
        if with_prior:  # MAP's fused node (p = 0: the same values and gradients as MAP's)
            views, term = penalised([self.theta[n] for n in with_prior], [self.prior.mean[n] for n in with_prior],
                                    [0.5 / self.prior_std**2] * len(with_prior))
            sample.update(zip(with_prior, views))
            penalty = term if penalty is None else penalty + term
        if penalty is None:
            penalty = self.regularizer()
        return {n: sample[n] for n in names}, penalty

    def regularizer(self) -> torch.Tensor:
        """Σ_i (1 − p_i)(m_i − θ̄_i)² / (2σ²), the KL approximation of eq. 10, in nats (``mode="layers"``: p_i = 0,
        MAP's Σ_i (M_i − θ̄_i)² / (2σ²)).
        """
        return self.prior.penalty(self.theta.as_dict(), scale={n: 1.0 - p for n, p in self.drop_prob.items()})

    def posterior_mean(self):
        """Mixture mean (1 − p) m + p θ̄, ``{name: tensor}`` (``mode="layers"``: the weights M, the mean of the
        inverted-dropout weights M diag(z) / (1 − p)).
        """
        return {n: m if self.drop_prob[n] == 0 else (1 - self.drop_prob[n]) * m + self.drop_prob[n] * self.prior.mean[n]
                for n, m in self.theta.items()}

    def posterior_std(self):
        """Mixture std sqrt(p (1 − p)) |m − θ̄|, ``{name: tensor}`` (``mode="layers"``: zeros, the spread is in
        the masks).
        """
        return {n: (self.drop_prob[n] * (1 - self.drop_prob[n])) ** 0.5 * (m - self.prior.mean[n]).abs()
                for n, m in self.theta.items()}

    def _draw(self, num_samples, generator):
        """Draws S dropout samples θ_s = z_s ⊙ m + (1 − z_s) ⊙ θ̄, ``{name: (S, *shape)}``.

        With ``mode="layers"`` the parameters are not dropped: M repeated S times (a view);
        the masks are drawn on the units by :meth:`~bayeswrap.BayesianModel.sample_logits`.
        """
        return self._masked((num_samples,), generator)

    def default_predictive(self, model: str = "full", **options) -> Predictive:
        """:class:`Sampled`; ``mode="layers"``: with the dropout modules active (``Sampled(context=...)``).

        The S forward passes run as one ``vmap`` with ``randomness="different"`` (a mask
        per sample), ``chunk_size`` at a time. Dropout draws from the global RNG; with a
        ``generator`` the RNG is seeded from it inside ``torch.random.fork_rng`` (the global
        state is left as it was), so a seeded generator reproduces the outputs.

        Raises:
            ValueError: on a ``model`` other than ``"full"``.
            TypeError: on any other option.
        """
        default = super().default_predictive(model=model, **options)
        return default if self.mode == "params" else Sampled(context=MCDropout._dropout_context)

    @contextlib.contextmanager
    def _dropout_context(self, x, generator: torch.Generator | None):
        """The dropout modules active, and the global RNG seeded from ``generator`` (if any), around a prediction."""
        with self._active_dropout(), _seeded(generator, x):
            yield

    @contextlib.contextmanager
    def _active_dropout(self):
        """Switches the copy's dropout modules to train mode (the rest keeps its mode), and back."""
        modes = {name: m.training for name, m in self._dropout_modules.items()}
        try:
            for m in self._dropout_modules.values():
                m.train(True)
            yield
        finally:
            for name, m in self._dropout_modules.items():
                m.train(modes[name])

    def get_extra_state(self):
        return {**super().get_extra_state(), "mode": self.mode, "layer_p": self.layer_p}

    def set_extra_state(self, state):
        super().set_extra_state(state)
        theirs = (state.get("mode", "params"), state.get("layer_p"))
        if theirs != (self.mode, self.layer_p):
            raise ValueError(f"checkpoint is for mode={theirs[0]!r}, layer_p={theirs[1]!r}, but this model has "
                             f"mode={self.mode!r}, layer_p={self.layer_p!r}; accepted: wrap with the checkpoint's "
                             "mode and layer_p")


def _seeded(generator: torch.Generator | None, x):
    """A context in which the global RNG is seeded from ``generator`` (restored afterwards), or nothing without one."""
    if generator is None:
        return contextlib.nullcontext()
    return _fork_seeded(int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)), x)


@contextlib.contextmanager
def _fork_seeded(seed: int, x):
    device = x_device(x)
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        yield
