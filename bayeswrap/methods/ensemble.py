"""Ensembles of any method: deep ensembles, MultiSWAG, and mixtures of VI, Laplace, SGLD, ... members.

An :class:`Ensemble` holds M complete Bayesian models of one registered method
(the *members*), each built from its own copy of the wrapped model's trainable tensors and buffers:

* **One frozen base.** The frozen (``requires_grad=False``) parameters, e.g. a peft model's base, are not copied:
  every member references the wrapped model's own tensors (never writing to them), they are passed to the vmapped
  loss once, unbatched, and ``.to(device)`` moves them once for all members. Only the trainable tensors (LoRA's
  adapters, a head) and the buffers are per member, so M members of a LoRA model cost about the base plus M times
  the adapters and their posterior state.
* **Initialisation.** Member m re-draws the parameters chosen by ``reinit`` from
  their initialisers under the seed ``init_seed + m`` (:mod:`bayeswrap.methods.reinit`);
  every other weight keeps the wrapped model's value. The default ``reinit="bayesian"``
  re-draws the Bayesian parameters that are trainable, and never a frozen
  (``requires_grad=False``) or non-Bayesian one: the pretrained weights stay. With
  ``params=None`` on a model trained from scratch that is every trainable parameter,
  the deep ensemble of Lakshminarayanan et al. 2017 ("Simple and Scalable Predictive
  Uncertainty Estimation using Deep Ensembles", NeurIPS, §2.4). With
  ``params="last_layer"`` on a pretrained backbone it is the head: the body starts
  from the pretrained weights in every member and only the head differs, the usual
  recipe for fine-tuned ensembles (the command line passes the head for pretrained
  backbones). For a peft LoRA model it is the adapters, re-drawn by peft's own
  initialisation (random A, zero B), so every member starts at the pretrained function. Pass ``reinit`` explicitly for a
  pretrained model whose every weight is Bayesian (``params=None``): the head's names,
  or ``"none"``; and ``reinit="all"`` for a model trained from scratch whose Bayesian
  parameters are only some (``params="last_layer"``), so that each member's body is
  drawn afresh too. With ``prior_mean="init"`` each member's prior is centred at its own
  initial weights (the pretrained body is the prior mean of every member).
* **Training.** ``bw.fit`` trains all members at once. The loss is the *sum* of
  the members' losses (each member's gradient is exactly the one it would get
  alone), so every element-wise optimizer (SGD with momentum, AdamW, SGLD)
  steps each member as if it were trained on its own. Gradient clipping by
  global norm (``grad_clip_norm``) acts on all members together. Every member
  sees the same minibatch at each step; members differ in their initialisation
  and in their method's own randomness (VI's draws, SGLD's noise), which Fort et
  al. 2019 ("Deep Ensembles: A Loss Landscape Perspective") found to be the
  dominant source of ensemble diversity. The reported ``nll`` is the mean over
  members.
* **One process, vmapped.** With ``parallel="auto"`` the members' losses run as
  one ``torch.func.vmap`` over stacked parameters and buffers (as
  ``torch.func.stack_module_state`` stacks them), so an epoch of five small
  members costs far less than five epochs. Where a member's forward cannot be
  vmapped (an op without a batching rule, a data-dependent branch), the members
  run one after another, with one warning saying so.
* **Predictive.** The mixture over members and each member's posterior
  (Wilson & Izmailov 2020, "Bayesian Deep Learning and a Probabilistic
  Perspective of Generalization", eq. 3 and MultiSWAG §4): S total draws are split
  evenly, member m getting ⌊S/M⌋ or ⌈S/M⌉ of them (the first S mod M members one
  more), so p(y|x) = (1/S) Σ_m S_m p̂_m(y|x) with p̂_m the member's own predictive
  from S_m draws. A point-estimate member (MAP) is evaluated once and weighted by
  S_m. ``num_samples=0`` averages the members' posterior means equally.

``member="map"`` is a deep ensemble; ``member="swag"`` is MultiSWAG (also
registered as ``"multiswag"``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils.checkpoint import checkpoint

from bayeswrap.core.batches import class_labels
from bayeswrap.core.checks import check_int
from bayeswrap.core.functional import NamedTensors
from bayeswrap.core.likelihoods import PROBABILITY_LIKELIHOODS, at_least_float32
from bayeswrap.core.modules import checked_once, unwrap_compiled
from bayeswrap.methods.base import (
    COMMON_OPTIONS,
    METHODS,
    BayesianModel,
    LossOutput,
    method_option_defaults,
    register_method,
)
from bayeswrap.methods.map import MAP
from bayeswrap.methods.option_types import check_option_types
from bayeswrap.methods.predictives import Mixture, Predictive, mixture
from bayeswrap.methods.reinit import REINIT_ACCEPTED, check_reinit, reinit_parameters, reinitialise
from bayeswrap.methods.swag import SWAG

#: accepted values of ``parallel``
PARALLEL = ("auto", "vmap", "sequential", "checkpoint")
#: keys of a member's state that the wrapped model's forward may update in place (BatchNorm statistics)
_MUTABLE_PREFIX = "model_buffers."
#: keys of a member's frozen tensors, which the members share (one frozen base)
_FROZEN_PREFIX = "frozen."


class _MemberOutputs(nn.Module):
    """``forward(x)`` = a member's training outputs (num_train_samples, B, ·) and regulariser, for ``functional_call``."""

    def __init__(self, member: BayesianModel):
        super().__init__()
        self.member = member

    def forward(self, x):
        outs, kl = self.member._train_outputs(x)
        return torch.stack(outs), kl


@register_method("ensemble", order=130)
class Ensemble(BayesianModel):
    """M members of one method, trained together with the members vmapped and predicting as a mixture (deep
    ensembles: Lakshminarayanan et al. 2017).

    Takes the arguments of :class:`~bayeswrap.BayesianModel` (passed on to every
    member) plus:

    Args:
        num_members: M, the number of members (integer ≥ 1; default 5, the usual deep-ensemble size).
        member: the registered method of the members (default ``"map"``: a deep
            ensemble; ``"swag"``: MultiSWAG). Not ``"ensemble"`` itself, nor a
            full-batch sampler (``"mh"``, ``"hmc"``), which ``bw.fit`` does not train.
        member_kwargs: the member method's own options, e.g. ``{"p_drop": 0.1}``
            for ``member="mc_dropout"`` (``None``: its defaults).
        reinit: which parameters each member re-draws from their initialisers (frozen parameters never are):
            ``"bayesian"`` (default: the Bayesian trainable parameters), ``"all"`` (every trainable
            parameter), ``"none"`` (every member starts from the model's weights), or a glob pattern or
            list of them over parameter names or the names of the modules holding them, as for ``params``
            (e.g. ``"fc.*"``, ``["fc"]``, ``["head.*"]``, ``"*lora_A*"``). See :mod:`bayeswrap.methods.reinit`.
        init_seed: member m initialises under ``torch.manual_seed(init_seed + m)`` (integer ≥ 0), or
            ``None`` (default): ``init_seed`` is drawn from torch's global generator, so
            ``torch.manual_seed`` (the command line's ``--seed``) reproduces the members.
        parallel: ``"auto"`` (vmap over members, falling back to one member at a
            time with a warning), ``"vmap"`` (vmap or an error), ``"sequential"``, or ``"checkpoint"``: one
            member at a time, each member's forward under activation checkpointing
            (``torch.utils.checkpoint``, non-reentrant, random state preserved), so that a training step holds
            the activations of one member instead of M, at the cost of a second forward per member in the
            backward pass. The memory-bounded choice for large models (a LoRA ensemble of a transformer, whose
            activations dominate once the members share the frozen base). Refused for models with BatchNorm,
            whose running statistics the second forward would update twice.

    Attributes:
        members: the M member models (an ``nn.ModuleList`` of the member method's class).
        reinitialised: for each member, the names of the parameters it re-drew (``reinit``), in model order.

    Raises:
        ValueError: for ``num_members`` < 1, an unknown or unsupported ``member``,
            options the member method does not accept, a ``reinit`` that is not
            one of the forms above (or a pattern that matches no trainable parameter, or
            chosen parameters none of which has an initialiser), an unknown ``parallel``, or
            ``parallel="checkpoint"`` on a model with BatchNorm layers.

    Example:
        >>> bnn = bw.wrap(model, "ensemble", num_data=len(train_set), num_members=5)   # deep ensemble
        >>> bw.fit(bnn, train_loader, epochs=20, optimizer=torch.optim.SGD(bnn.param_groups(), lr=0.1, momentum=0.9))
        >>> probs = bnn.predict(x, num_samples=5)                                       # one draw per member
    """

    tuning = MAP.tuning
    in_default_comparison = True
    default_member = "map"
    supports_learned_noise = False  # each member would need its own σ in the vmapped loss and the mixture

    @classmethod
    def run_options(cls, run) -> dict:
        """A fine-tuned ensemble (pretrained weights with a new head) gets a freshly initialised head per member:
        ``reinit`` = the head's modules (whatever ``params`` is), unless the run gives ``reinit``. A model trained
        from scratch takes the constructor's default (the Bayesian trainable parameters: every trainable one unless
        ``params`` narrows them).
        """
        if run.pretrained and "reinit" not in run.options:
            return {"reinit": sorted({name.rsplit(".", 1)[0] for name in run.head})}
        return {}

    def __init__(self, model, *, num_members: int = 5, member: str | None = None, member_kwargs: dict | None = None,
                 reinit: str | list[str] = "bayesian", init_seed: int | None = None, parallel: str = "auto", **kwargs):
        member = self.default_member if member is None else member
        self.num_members = check_int("num_members", num_members, minimum=1, note="ensemble members")
        accepted = tuple(m for m, cls in METHODS.items() if not issubclass(cls, Ensemble) and m not in ("mh", "hmc"))
        if member not in accepted:
            raise ValueError(f"member={member!r} is not accepted; accepted: {accepted} (full-batch samplers run "
                             "their own chains; ensembles of ensembles are not supported)")
        self.member = member
        if member_kwargs is not None and not isinstance(member_kwargs, Mapping):
            raise ValueError(f"member_kwargs={member_kwargs!r} is not accepted; accepted: None or a mapping "
                             f"{{option: value}} of options of the member method {member!r}")
        self.member_kwargs = dict(member_kwargs or {})
        from_signature = method_option_defaults(member)
        unknown = sorted(k for k in self.member_kwargs if k not in from_signature)
        if unknown:
            raise ValueError(f"member_kwargs {unknown} are not options of method {member!r}; accepted: "
                             f"{sorted(from_signature)} (the common options, e.g. prior_std, are given to the "
                             "ensemble itself and passed on to every member)")
        check_option_types(METHODS[member], self.member_kwargs)
        self.reinit = check_reinit(reinit)
        if init_seed is None:
            init_seed = int(torch.randint(0, 2**31, ()))
        self.init_seed = check_int("init_seed", init_seed, minimum=0, note="member m initialises with init_seed + m")
        if parallel not in PARALLEL:
            raise ValueError(f"parallel={parallel!r} is not accepted; accepted: {PARALLEL}")
        self.parallel = parallel
        if parallel == "checkpoint":
            norms = [n for n, m in unwrap_compiled(model).named_modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
            if norms:
                raise ValueError(f"parallel='checkpoint' recomputes each member's forward in the backward pass, which "
                                 f"would update the running statistics of BatchNorm layers {norms[:3]} twice; "
                                 "accepted for this model: parallel='auto', 'vmap' or 'sequential'")
        self._build = (unwrap_compiled(model), {k: kwargs[k] for k in COMMON_OPTIONS if k in kwargs})
        member_cls = METHODS[member]
        self.required_optimizer = member_cls.required_optimizer
        self.select_best_epoch = member_cls.select_best_epoch
        self.reads_train_loader_after_fit = member_cls.reads_train_loader_after_fit
        self.bias_options = member_cls.bias_options
        self._vmap_state = "untried" if parallel not in ("sequential", "checkpoint") else "off"
        self._state_cache = self._stacked_buffers = None  # the vmapped loss's view of the members' state
        super().__init__(model, **kwargs)

    # ------------------------------------------------------------------ members
    def _init_posterior(self, init):
        model, common = self._build
        self._build = None  # no reference to the user's model is kept
        members = []
        self.reinitialised: list[list[str]] = []  # the parameter names each member re-drew
        for m in range(self.num_members):
            net = _member_copy(model)
            chosen = reinit_parameters(net, self.reinit, self.bayesian_names)
            done = reinitialise(net, chosen, self.init_seed + m)
            if chosen and not done and self.reinit != "bayesian":
                raise ValueError(f"reinit={self.reinit!r} chooses parameters none of which has an initialiser (a "
                                 f"reset_parameters() on its module or an ancestor), e.g. {chosen[:3]}; accepted: "
                                 f"{REINIT_ACCEPTED}")
            self.reinitialised.append(done)
            with checked_once(model):  # the shared frozen base was checked when the ensemble was wrapped
                members.append(METHODS[self.member](net, **common, **self.member_kwargs))
            del net
        self.members = nn.ModuleList(members)
        self.register_load_state_dict_post_hook(_share_frozen)
        # the members own every trainable tensor and share the frozen ones: the ensemble keeps no point estimates
        # or frozen tensors of its own
        self.point = NamedTensors({}, trainable=True)
        self.frozen = NamedTensors({}, trainable=False)
        self.model_buffers = NamedTensors({}, trainable=False)
        if self.num_members > 1 and not any(self.reinitialised) and type(members[0]) is MAP:
            warnings.warn(f"reinit={self.reinit!r} re-initialises nothing with MAP members: every member starts from "
                          "the same weights and sees the same batches, so all members stay identical; use "
                          "reinit='all' or the head's names (e.g. reinit='fc.*')", RuntimeWarning, stacklevel=4)

    def _prior_bias(self, bias: str) -> str:
        return METHODS[self.member]._prior_bias(self, bias)

    def _train_sample(self):
        raise NotImplementedError("an ensemble has no single training sample; its loss is the members' (see loss)")

    def regularizer(self) -> torch.Tensor:
        """Σ_m of the members' KL or −log prior terms, in nats."""
        return sum(member.regularizer() for member in self.members)

    def not_trained_by_fit(self) -> str | None:
        return self.members[0].not_trained_by_fit()

    def is_ready(self) -> bool:
        return all(member.is_ready() for member in self.members)

    def _not_ready_message(self) -> str:
        waiting = [i for i, member in enumerate(self.members) if not member.is_ready()]
        return (f"ensemble members {waiting} have no posterior yet: "
                f"{self.members[waiting[0]]._not_ready_message()}")

    def before_fit(self, num_steps, optimizer=None, steps_per_epoch=None) -> None:
        for member in self.members:
            member.before_fit(num_steps, optimizer, steps_per_epoch)

    def after_step(self) -> None:
        for member in self.members:
            member.after_step()

    def after_fit(self, train_loader) -> None:
        for member in self.members:
            member.after_fit(train_loader)

    def train(self, mode: bool = True):
        nn.Module.train(self, mode)  # every member sets its own structure's mode
        return self

    def param_groups(self, head=(), lr_head=None) -> list[dict]:
        """The members' optimizer groups (see :meth:`BayesianModel.param_groups`), merged by group name."""
        merged: dict[str, dict] = {}
        for member in self.members:
            for group in member.param_groups(head, lr_head):
                target = merged.setdefault(group["name"], {**group, "params": []})
                target["params"].extend(group["params"])
        return list(merged.values())

    # ------------------------------------------------------------------ training
    def loss(self, x, y) -> LossOutput:
        """Σ_m of the members' losses on the same batch (vmapped over members where possible).

        Returns:
            A :class:`LossOutput`: ``loss`` the sum over members (so each member
            gets its own gradient), ``nll`` the mean of the members' NLLs, ``kl``
            the sum of their regularisers, ``logits`` the log of the members'
            mean softmax (categorical) or their mean output (regression), (B, K) or (B, D).

        Raises:
            ValueError: as :meth:`BayesianModel.loss`; with ``parallel="vmap"``,
                also when the members cannot be vmapped.
        """
        if self.likelihood.name == "categorical":
            y = class_labels(y)
        if self._vmap_state != "off":
            try:
                outs, kls = self._vmapped_outputs(x)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:
                if self._vmap_state == "on" and self.parallel != "vmap":
                    raise
                if self.parallel == "vmap":
                    raise ValueError(f"parallel='vmap': the members cannot be evaluated under torch.func.vmap "
                                     f"({type(err).__name__}: {err}); accepted: parallel='auto' or "
                                     "'sequential'") from err
                out = self._sequential_loss(x, y)  # the members' own error, if the input is bad
                self._vmap_state = "off"
                warnings.warn(f"the {self.num_members} {self.member!r} members cannot be trained under "
                              f"torch.func.vmap ({type(err).__name__}: {str(err)[:200]}); they are trained one "
                              "after another from now on", RuntimeWarning, stacklevel=2)
                return out
            self._vmap_state = "on"
            return self._checked_loss(self._loss_output_members(outs, kls, y), x, y)
        return self._sequential_loss(x, y)

    def _unchecked_loss(self, x, y) -> LossOutput:
        """:meth:`loss` without its data checks (:meth:`BayesianModel._unchecked_loss`), the members run as
        :meth:`loss` last ran them (vmapped, or one after another).
        """
        if self._vmap_state == "on":
            outs, kls = self._vmapped_outputs(x)
            return self._loss_output_members(outs, kls, y, check=False)
        return self._sequential_loss(x, y, checked=False)

    def _sequential_loss(self, x, y, checked: bool = True) -> LossOutput:
        if self.parallel == "checkpoint" and torch.is_grad_enabled():
            return self._checkpointed_loss(x, y, checked)
        outs = [(member.loss if checked else member._unchecked_loss)(x, y) for member in self.members]
        return LossOutput(sum(o.loss for o in outs), sum(o.nll for o in outs) / len(outs),
                          sum(o.kl for o in outs), self._combine(torch.stack([o.logits for o in outs])))

    def _checkpointed_loss(self, x, y, checked: bool = True) -> LossOutput:
        """The members' losses one at a time, each under activation checkpointing (``parallel="checkpoint"``).

        Only the members' scalar losses stay in the graph: their outputs are combined detached (a running log mean
        softmax, or mean) and dropped member by member, so that a step holds one member's activations and one
        output tensor, not M of each (for a causal LM, M × (B, T, V) logits).
        """
        probability = self.likelihood.name in PROBABILITY_LIKELIHOODS
        loss = nll = kl = combined = None
        for member in self.members:
            out = LossOutput(*checkpoint(_loss_fields, member, x, y, checked, use_reentrant=False))
            part = at_least_float32(out.logits.detach())
            part = part.log_softmax(-1) if probability else part
            combined = part if combined is None else (torch.logaddexp(combined, part) if probability
                                                      else combined + part)
            loss, nll, kl = ((out.loss, out.nll, out.kl) if loss is None
                             else (loss + out.loss, nll + out.nll, kl + out.kl))
            del out, part
        m = len(self.members)
        return LossOutput(loss, nll / m, kl, combined - math.log(m) if probability else combined / m)

    def _vmapped_outputs(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """Every member's training outputs (M, num_train_samples, B, ·) and regularisers (M,), in one vmap.

        The parameters are stacked at every call (differentiably: each member's gradient flows back to its own
        tensors). Buffers are stacked once and reused while none of them changed (same tensors, same version
        counters); BatchNorm statistics updated under vmap are copied back to their members. Tensors that every
        member shares (the frozen base) are passed once, not stacked.
        """
        params, buffers, shared, _ = self._member_state()
        stacked = {f"member.{n}": torch.stack(ts) for n, ts in params.items()}
        compiling = torch.compiler.is_compiling()
        if compiling:  # in a compiled step (bayeswrap.compiled) the stack is part of the graph: no version counters
            stacked_buffers = {f"member.{n}": torch.stack(ts) for n, ts in buffers.items()}
        else:
            key = tuple((id(t), t._version) for ts in buffers.values() for t in ts)
            if self._stacked_buffers is None or self._stacked_buffers[0] != key:
                self._stacked_buffers = (key, {f"member.{n}": torch.stack(ts) for n, ts in buffers.items()})
            stacked_buffers = self._stacked_buffers[1]
        template = self._state_cache[3]
        out = vmap(lambda state, common: functional_call(template, {**state, **common}, (x,)), in_dims=(0, None),
                   randomness="different")({**stacked, **stacked_buffers}, shared)
        if self.training:
            with torch.no_grad():
                changed = False
                for name, ts in buffers.items():
                    if name.startswith(_MUTABLE_PREFIX):
                        for m, t in enumerate(ts):
                            t.copy_(stacked_buffers[f"member.{name}"][m])
                            changed = True
                if changed and not compiling:  # the copies bumped the members' version counters: refresh the key
                    self._stacked_buffers = (tuple((id(t), t._version) for ts in buffers.values() for t in ts),
                                             stacked_buffers)
        return out

    def _member_state(self):
        """``({name: [tensor of each member]}, same for buffers, {"member." + name: tensor} of the buffers every
        member shares (the frozen base), the functional template)`` of the state the members' loss reads (cached,
        and dropped by ``.to()`` and ``load_state_dict``; the template is kept out of the module tree).
        """
        if self._state_cache is None:
            skip = tuple(self.members[0].loss_free_state)

            def gather(named):
                per = [{n: t for n, t in named(member) if not n.startswith(skip)} for member in self.members]
                return {n: [p[n] for p in per] for n in per[0]}

            buffers = gather(lambda m: m.named_buffers())
            common = {n for n, ts in buffers.items()  # the frozen base (never updated in place, unlike BatchNorm's)
                      if n.startswith(_FROZEN_PREFIX) and all(_view(t) == _view(ts[0]) for t in ts)}
            self._state_cache = (gather(lambda m: m.named_parameters()),
                                 {n: ts for n, ts in buffers.items() if n not in common},
                                 {f"member.{n}": buffers[n][0] for n in common}, _MemberOutputs(self.members[0]))
        return self._state_cache

    def _apply(self, fn, *args, **kwargs):
        """``nn.Module._apply`` (``.to()``, ``.double()``, ...), converting a frozen tensor that the members share
        once, so that they still share one converted tensor; the cached view of the members' state is dropped.
        """
        self._state_cache = self._stacked_buffers = None
        frozen = {id(t) for member in getattr(self, "members", ()) for t in member.frozen.values()}
        done: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

        def once(t):
            if id(t) not in frozen:
                return fn(t)
            key = _view(t)
            if key not in done:
                done[key] = (t, fn(t))  # the source is kept alive, so its memory is not reused during the walk
            return done[key][1]

        return super()._apply(once, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        # a checkpoint may replace the members' referenced frozen tensors (NamedTensors): drop the cached view
        self._state_cache = self._stacked_buffers = None
        return super()._load_from_state_dict(*args, **kwargs)

    def _loss_output_members(self, outs: torch.Tensor, kls: torch.Tensor, y, check: bool = True) -> LossOutput:
        """:meth:`BayesianModel.loss` of every member at once from (M, S_train, B, ·) outputs, summed over members.

        The likelihood runs once on the flattened outputs (cheaper than under vmap); ``check=False`` skips the
        targets' check (done by the caller).
        """
        first = self.members[0]
        if check:
            first.likelihood.check_targets(outs[0, 0], y)
        count = outs.shape[0] * outs.shape[1]
        targets = y.expand(count, *y.shape).reshape(-1, *y.shape[1:])
        nll = first.likelihood.nll(outs.reshape(-1, *outs.shape[3:]), targets, reduction="none")
        nlls = nll.reshape(outs.shape[0], -1).mean(1)  # each member's mean over its S_train samples and the batch
        losses = nlls + (first.kl_weight / first.num_data) * kls
        return LossOutput(losses.sum(), nlls.mean(), kls.sum(), self._combine(outs[:, -1]))

    def _combine(self, logits: torch.Tensor) -> torch.Tensor:
        """(M, B, ·) member outputs → one (B, ·) output: log mean softmax (categorical) or the mean."""
        if self.likelihood.name in PROBABILITY_LIKELIHOODS:
            return at_least_float32(logits).log_softmax(-1).logsumexp(0) - math.log(logits.shape[0])
        return logits.mean(0)

    # ------------------------------------------------------------------ posterior
    def draws_per_member(self, num_samples: int) -> list[int]:
        """S split over the M members: ⌊S/M⌋ each, the first S mod M members one more.

        Raises:
            ValueError: if ``num_samples`` is not an integer >= 1.
        """
        num_samples = check_int("num_samples", num_samples, minimum=1)
        base, extra = divmod(num_samples, self.num_members)
        return [base + (m < extra) for m in range(self.num_members)]

    def posterior_mean(self):
        """The mixture's mean, (1/M) Σ_m E_m[θ], ``{name: tensor}``."""
        means = [member.posterior_mean() for member in self.members]
        return {n: torch.stack([m[n] for m in means]).mean(0) for n in means[0]}

    def posterior_std(self):
        """The mixture's marginal std, sqrt((1/M) Σ_m (std_m² + mean_m²) − mean²), ``{name: tensor}``."""
        means = [member.posterior_mean() for member in self.members]
        stds = [member.posterior_std() for member in self.members]
        out = {}
        for n in means[0]:
            mu = torch.stack([m[n] for m in means])
            second = (torch.stack([s[n] for s in stds]).pow(2) + mu.pow(2)).mean(0)
            out[n] = (second - mu.mean(0).pow(2)).clamp_min(0).sqrt()
        return out

    def _draw(self, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """S draws from the mixture, member m contributing :meth:`draws_per_member` of them, ``{name: (S, *shape)}``.

        Raises:
            NotFittedError: if a member has no posterior yet.
        """
        parts = [member.sample(s, generator) for member, s in zip(self.members, self.draws_per_member(num_samples))
                 if s]
        return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}

    @contextlib.contextmanager
    def shared_draws(self):
        """Every member's ``shared_draws()`` context, for those that have one (SWAG members: MultiSWAG), see
        :meth:`bayeswrap.SWAG.shared_draws`.
        """
        with contextlib.ExitStack() as stack:
            for member in self.members:
                scope = getattr(member, "shared_draws", None)
                if callable(scope):
                    stack.enter_context(scope())
            yield self

    def default_predictive(self, model: str = "full", **options) -> Predictive:
        """The mixture of the members' predictives, :class:`~bayeswrap.methods.predictives.Mixture`
        (1/S) Σ_m S_m p̂_m(y|x) (see the module docstring); ``predict(x, 0)`` averages the members'
        posterior-mean predictions equally.

        Raises:
            ValueError: on a ``model`` other than ``"full"``.
            TypeError: on any other option.
        """
        super().default_predictive(model=model, **options)
        return Mixture()

    def forward_with(self, theta, x):
        raise NotImplementedError("an ensemble has one set of weights per member: use "
                                  "bnn.members[m].forward_with(theta, x), or bnn.predict / bnn.sample_logits")

    def _point_estimate(self):
        raise NotImplementedError("an ensemble has no single point estimate; see predict(x, num_samples=0)")

    def _mean_outputs(self, x) -> torch.Tensor:
        """Each member's outputs at its posterior mean, (M, B, ·)."""
        return torch.cat([member._mean_outputs(x) for member in self.members])

    def _point_predictive(self, x):
        """The equal-weight mixture of the members' training-state predictives (validation before collection)."""
        preds = [member._point_predictive(x) for member in self.members]
        return mixture(self.likelihood.name, preds, [1.0 / len(preds)] * len(preds))

    def to_deterministic(self) -> nn.Module:
        """Refused: an ensemble has no single mean network.

        Raises:
            ValueError: always, naming ``bnn.members[m].to_deterministic()`` to deploy a member instead.
        """
        raise ValueError(f"an ensemble of {self.num_members} {self.member!r} members has no single set of "
                         "deterministic weights (its predictive is the mixture of the members'); deploy a member "
                         "instead: bnn.members[m].to_deterministic()")

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self):
        return {**super().get_extra_state(), "member": self.member, "num_members": self.num_members}

    def set_extra_state(self, state):
        super().set_extra_state(state)
        theirs = (state.get("member"), state.get("num_members"))
        if theirs != (self.member, self.num_members):
            raise ValueError(f"checkpoint is an ensemble of {theirs[1]} {theirs[0]!r} members, but this model has "
                             f"{self.num_members} {self.member!r} members")


@register_method("multiswag", order=140)
class MultiSWAG(Ensemble):
    """MultiSWAG (Wilson & Izmailov 2020, §4): an :class:`Ensemble` whose members are SWAG models.

    Exactly ``bw.wrap(model, "ensemble", member="swag", ...)``; registered under its
    own name so that comparisons list it. Takes the arguments of :class:`Ensemble`.
    """

    default_member = "swag"
    recommended = SWAG.recommended  # SWAG's recipe (SGD with momentum) for every member

    @classmethod
    def run_options(cls, run) -> dict:
        """:meth:`Ensemble.run_options`, and for SWAG members what :meth:`SWAG.run_options` implies for the
        run (``swa_lr=None`` under a learning-rate schedule), in ``member_kwargs``.

        Raises:
            ValueError: as :meth:`SWAG.run_options`, for a ``swa_lr`` in ``member_kwargs`` under a schedule.
        """
        out = super().run_options(run)
        if run.options.get("member", cls.default_member) != "swag":
            return out
        given = dict(run.options.get("member_kwargs") or {})
        implied = SWAG.run_options(dataclasses.replace(run, options=given))
        return {**out, "member_kwargs": {**given, **implied}} if implied else out


def _member_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` that shares its frozen (``requires_grad=False``) parameters: every member's trainable
    tensors and buffers are its own, the frozen base is the wrapped model's (and is never written to,
    :func:`~bayeswrap.methods.reinit.reinitialise`).
    """
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo)


def _share_frozen(ens: Ensemble, incompatible_keys) -> None:
    """After ``load_state_dict``: members whose frozen tensors a checkpoint replaced by equal values (a checkpoint
    of another base, :class:`~bayeswrap.core.functional.NamedTensors`) share one of them again.
    """
    first = ens.members[0].frozen
    for key, tensor in list(first._buffers.items()):
        for member in ens.members[1:]:
            other = member.frozen._buffers.get(key)
            if other is not None and _view(other) != _view(tensor) and torch.equal(other, tensor):
                member.frozen._buffers[key] = tensor
                member.frozen._referenced.discard(key)
    ens._state_cache = ens._stacked_buffers = None


def _view(t: torch.Tensor) -> tuple:
    """What makes two tensor objects the same tensor: one memory, read the same way (members' frozen tensors are
    separate ``detach()`` views of the wrapped model's parameters).
    """
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _loss_fields(member: BayesianModel, x, y, checked: bool = True) -> tuple:
    """A member's :class:`LossOutput` as a tuple of tensors (what ``torch.utils.checkpoint`` returns)."""
    return tuple(member.loss(x, y) if checked else member._unchecked_loss(x, y))
