"""The adapter tensors of a peft model: what ``params="adapters"`` (and BLoB's ``"adapters_A"``) selects.

A peft tuner (LoRA, AdaLoRA, IA³, LoHa, LoKr, VeRA, DoRA's magnitude, ...) wraps each adapted layer of the base
model in a *tuner layer* (peft's ``BaseTunerLayer``), which names the attributes that hold its adapter weights in
``adapter_layer_names`` (LoRA: ``lora_A``, ``lora_B``, ``lora_embedding_A``, ``lora_embedding_B``; IA³:
``ia3_l``). The rule, read from the model without importing peft:

* the **adapters** are the trainable (``requires_grad=True``) parameters held under one of its tuner layers'
  ``adapter_layer_names`` (every adapter name, e.g. ``...q_proj.lora_A.default.weight``);
* peft's ``modules_to_save`` copies (a new classifier head of a ``task_type="SEQ_CLS"`` model) are not adapters:
  they are trained as point estimates beside the Bayesian adapters (``params=None`` makes them Bayesian too);
* everything else is the *base*, which peft freezes (``requires_grad=False``); bayeswrap keeps it as a frozen
  buffer in the model's own dtype (bf16/fp16 stay as they are), so no optimizer built from ``bnn.parameters()`` can
  update it. It is not copied either: the wrapped model's frozen tensors are referenced (and never written to), and
  the members of an ensemble or MultiSWAG share them, so M members cost the base once plus M times the adapters.

The posterior state of the adapters (means, stds, curvature, stored draws) is fp32 even when they are bf16/fp16
(peft's ``autocast_adapter_dtype=False``); their values are cast to the adapters' dtype where the model is called
(:meth:`bayeswrap.BayesianModel.forward_with`).

Prompt-learning methods (prompt/prefix tuning, P-tuning) keep their virtual tokens in a ``prompt_encoder`` outside
any tuner layer; they are not covered (select them with a glob pattern such as ``"prompt_encoder.*"``).

The prior mean (``prior_mean="init"``, the default) is the adapter's value when the model is wrapped: for a fresh
LoRA adapter B = 0 (so the adapted model starts at the pretrained function, which is the base, not part of the
posterior) and A its random initialisation (kaiming-uniform with a = √5, or N(0, 1/r²) for
``init_lora_weights="gaussian"``). ``prior_mean="zero"`` centres A at zero instead. BLoB (Wang et al., NeurIPS 2024,
§3) puts the Gaussian posterior on A only and keeps B a point estimate: ``params="adapters_A"`` selects the A
factors (``lora_A``, ``lora_embedding_A``) and leaves the B factors trainable point estimates.
"""

from __future__ import annotations

from torch import nn

#: the string forms of ``params`` that select adapters
ADAPTER_SELECTORS = ("adapters", "adapters_A")
#: ``params`` values accepted by :func:`bayeswrap.core.functional.select_parameters`, for error messages
PARAMS_ACCEPTED = ("None (every trainable parameter), 'last_layer' (the classifier), 'adapters' (the peft adapter "
                   "tensors), 'adapters_A' (LoRA's A factors, BLoB), a glob pattern or a non-empty list of them over "
                   "parameter names (e.g. ['head.*']), or a callable (name, tensor) -> bool")
#: peft's name of the layer that holds ``modules_to_save`` copies: a full trainable module, not an adapter
_MODULES_TO_SAVE = "modules_to_save"
#: LoRA's A factors (BLoB's Bayesian part)
_A_PARTS = ("lora_A", "lora_embedding_A")


def adapter_parameter_names(model: nn.Module) -> list[str]:
    """Names of the trainable adapter parameters of a peft model, in ``named_parameters()`` order.

    Args:
        model: any ``nn.Module``; a ``peft.PeftModel`` or a model that ``peft.inject_adapter_in_model`` adapted.

    Returns:
        The names (empty for a model without peft tuner layers, or whose adapters are all frozen).
    """
    found: set[str] = set()
    for mod_name, mod in model.named_modules():
        layer_names = getattr(mod, "adapter_layer_names", None)
        if not isinstance(layer_names, tuple) or not layer_names:
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for part in layer_names:
            if part == _MODULES_TO_SAVE or not isinstance(getattr(mod, part, None), nn.Module | nn.Parameter):
                continue
            holder = getattr(mod, part)
            if isinstance(holder, nn.Parameter):
                found.add(f"{prefix}{part}")
            else:
                found.update(f"{prefix}{part}.{n}" for n, _ in holder.named_parameters())
    return [n for n, p in model.named_parameters() if p.requires_grad and n in found]


def select_adapters(model: nn.Module, which: str) -> list[str]:
    """The parameters ``params="adapters"`` or ``params="adapters_A"`` selects (see the module docstring).

    Args:
        model: the user's module.
        which: ``"adapters"`` (every adapter tensor) or ``"adapters_A"`` (LoRA's A factors only, BLoB).

    Returns:
        Parameter names, in ``model.named_parameters()`` order.

    Raises:
        ValueError: if the model has no trainable peft adapter parameter (naming its class and some of its
            trainable parameters, with the accepted values of ``params``); for ``"adapters_A"``, if none of them is
            a LoRA A factor; if a parameter that is neither an adapter nor a peft ``modules_to_save`` copy is
            trainable (an unfrozen base, which the optimizer would update as a point estimate: peft's
            ``get_peft_model`` freezes it); biases that peft itself made trainable (``LoraConfig(bias="all")`` or
            ``"lora_only"``) are accepted and stay point estimates.
    """
    adapters = adapter_parameter_names(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not adapters:
        some = trainable if len(trainable) <= 4 else [*trainable[:3], "..."]
        raise ValueError(f"params={which!r}: no peft adapter parameter was found in the {type(model).__name__} "
                         f"(no trainable tensor under a peft tuner layer such as LoRA's lora_A/lora_B; trainable "
                         f"parameters: {some}); wrap the model with peft.get_peft_model first, or choose params "
                         f"from: {PARAMS_ACCEPTED}")
    chosen = set(adapters)
    configs = getattr(model, "peft_config", None)
    peft_biases = isinstance(configs, dict) and any(getattr(c, "bias", "none") != "none" for c in configs.values())
    base = [n for n in trainable if n not in chosen and f".{_MODULES_TO_SAVE}." not in f".{n}"
            and not (peft_biases and n.rsplit(".", 1)[-1] == "bias")]
    if base:
        raise ValueError(f"params={which!r}: {len(base)} trainable parameters of the {type(model).__name__} are "
                         f"neither peft adapters nor modules_to_save (e.g. {base[:3]}): the base model is not "
                         "frozen, and the optimizer would update it; accepted: a frozen base (requires_grad=False, "
                         "as peft.get_peft_model leaves it), the new head in peft's modules_to_save, or params=None "
                         "/ glob patterns to choose them explicitly")
    if which == "adapters_A":
        a_only = [n for n in adapters if any(f".{part}." in f".{n}" for part in _A_PARTS)]
        if not a_only:
            raise ValueError(f"params='adapters_A' selects LoRA's A factors (lora_A, lora_embedding_A), but the "
                             f"{type(model).__name__}'s adapters have none (e.g. {adapters[:3]}); accepted: "
                             f"'adapters' for other peft tuners, or one of {PARAMS_ACCEPTED}")
        return a_only
    return adapters
