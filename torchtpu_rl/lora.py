"""LoRA learners: ``peft`` adapters on a Hugging Face policy, adapter-only weight sync, merged rollouts.

The learner trains a ``peft`` LoRA model (:meth:`LoraSpec.apply`: the base weights frozen, only the
adapters' ``lora_A`` / ``lora_B`` trained); a weight sync sends the adapter tensors only
(:func:`adapter_state_dict`: ``2 * rank * (in + out)`` numbers per target layer instead of
``in * out``). A rollout worker keeps a plain model (its KV cache, compiled decode steps and
quantization stay as they are) and merges each update into it: ``W = W_base + alpha / rank * B @ A``
from a copy of the base weights of the target layers it took at start (:class:`AdapterMerger`).
Both sides load the same base checkpoint, which LoRA training never changes.

``modules_to_save`` (peft's name) trains whole modules beside the adapters, e.g. the output layer
``lm_head``; a sync sends their full weights, which the rollout worker installs as they are. The
adapters of the trunk alone cannot move a model whose output layer is what limits it: a small or freshly
initialized model (logits ~0.1 in scale at init) keeps its output distribution whatever the trunk does
(measured in tests/rl/test_lora.py: training every linear layer but the output layer in full learns no
faster than LoRA there), where training ``lm_head`` too learns as full fine-tuning does. With tied input and
output embeddings the trained output layer is untied from the (frozen) input embeddings on both sides.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["AdapterMerger", "LoraSpec", "adapter_state_dict", "is_lora_model", "save_lora_hf"]


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """``rank``, ``alpha`` (the update is scaled by ``alpha / rank``, peft's default) and ``targets``:
    module-name suffixes (``"q_proj"``, ``"self_attn.v_proj"``) or ``"all-linear"`` (every linear
    layer but the output layer, peft's shorthand)."""

    rank: int = 8
    alpha: float = 16.0
    targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    modules_to_save: Sequence[str] = ()

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, not {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, not {self.alpha!r}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        if not self.targets:
            raise ValueError("LoRA targets: give at least one module name")
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.modules_to_save, str):
            object.__setattr__(self, "modules_to_save", (self.modules_to_save,))
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    def target_layers(self, model: nn.Module) -> list:
        """Names of the linear layers of ``model`` the targets select; a target that matches none is an
        error listing the linear layers there are."""
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        out_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if self.targets == ("all-linear",):
            return [n for n in linear if model.get_submodule(n) is not out_layer]
        chosen, unmatched = [], []
        for t in self.targets:
            hits = [n for n in linear if n == t or n.endswith("." + t)]
            if not hits:
                unmatched.append(t)
            chosen += [n for n in hits if n not in chosen]
        if unmatched:
            kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ValueError(f"LoRA targets {unmatched} match no linear layer of {type(model).__name__}; its linear "
                             f"layers are named {kinds} (e.g. {linear[0] if linear else 'none'})")
        return chosen

    def saved_modules(self, model: nn.Module) -> list:
        """Full names of the modules ``modules_to_save`` selects (trained in full); one that matches no
        module of ``model`` is an error naming it."""
        names = [n for n, _ in model.named_modules() if n]
        out = []
        for t in self.modules_to_save:
            hits = [n for n in names if n == t or n.endswith("." + t)]
            if not hits:
                raise ValueError(f"LoRA modules_to_save {t!r} matches no module of {type(model).__name__} (e.g. "
                                 f"{[n for n in names if '.' not in n][:8]})")
            out += [n for n in hits if n not in out]
        overlap = sorted(set(out) & set(self.target_layers(model)))
        if overlap:
            raise ValueError(f"LoRA: {overlap} are both adapter targets and modules_to_save; choose one")
        return out

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` as a peft LoRA model (base weights frozen, adapters and ``modules_to_save``
        trainable; ``B`` starts at 0, so the output is the base model's)."""
        import warnings

        from peft import LoraConfig, get_peft_model

        layers = self.target_layers(model)
        saved = self.saved_modules(model)
        config = LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=layers, lora_dropout=0.0,
                            bias="none", modules_to_save=saved or None)
        with warnings.catch_warnings():
            # a tied output layer in modules_to_save: its trained copy is untied on purpose (module doc)
            warnings.filterwarnings("ignore", message=".*tied.*", category=UserWarning)
            return get_peft_model(model, config)


def is_lora_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_state_dict(model: nn.Module) -> dict:
    """The adapter tensors of a peft model (what a weight sync sends), named as peft saves them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def save_lora_hf(model: nn.Module, tokenizer, out_dir) -> str:
    """The ``hf/`` export of a LoRA policy (on any device; left as it is): the adapters merged into the
    base weights as a plain ``transformers`` directory in ``out_dir`` (with the tokenizer), and the
    adapter alone (``adapter_config.json``, ``adapter_model.safetensors``) in ``out_dir/adapter``."""
    import copy
    import os

    from . import hf

    host = copy.deepcopy(model).to("cpu")
    host.save_pretrained(os.path.join(os.fspath(out_dir), "adapter"), safe_serialization=True)
    merged = host.merge_and_unload()
    if getattr(merged.config, "tie_word_embeddings", False) and _output_trained(host):
        merged.config.tie_word_embeddings = False  # the trained output layer is no longer the input embedding
    return hf.save_hf(merged, tokenizer, out_dir)


def _output_trained(peft_model) -> bool:
    saved = getattr(peft_model, "modules_to_save", None) or set()
    return any(n == "lm_head" or n.endswith(".lm_head") for n in saved)


class AdapterMerger:
    """Merges adapter updates into a plain model in place: ``W = W_base + scale * B @ A`` per target layer,
    from copies of the base weights taken at construction."""

    PREFIX = "base_model.model."

    def __init__(self, model: nn.Module, spec: LoraSpec):
        self.spec = spec
        self.layers = spec.target_layers(model)
        with torch.no_grad():
            self.base = {n: model.get_submodule(n).weight.detach().clone() for n in self.layers}
            # modules_to_save: their parameters arrive whole; a tied one gets its own tensor, as the
            # learner's trained copy is untied from the frozen input embeddings
            shared = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
                      if not any(n.startswith(m + ".") for m in spec.saved_modules(model))}
            self.full = {}
            for m in spec.saved_modules(model):
                mod = model.get_submodule(m)
                for pn, p in list(mod.named_parameters(recurse=False)):
                    if id(p) in shared:
                        setattr(mod, pn, nn.Parameter(p.detach().clone(), requires_grad=False))
                    self.full[f"{m}.{pn}"] = getattr(mod, pn)

    def reference(self) -> dict:
        """Meta tensors of the update's names, dtypes and shapes (what a sync must send)."""
        out = {}
        for n, w in self.base.items():
            out[f"{self.PREFIX}{n}.lora_A.weight"] = torch.empty((self.spec.rank, w.shape[1]), dtype=w.dtype,
                                                                 device="meta")
            out[f"{self.PREFIX}{n}.lora_B.weight"] = torch.empty((w.shape[0], self.spec.rank), dtype=w.dtype,
                                                                 device="meta")
        for n, p in self.full.items():
            out[f"{self.PREFIX}{n}"] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        return out

    def merged_weights(self, adapters: dict) -> dict:
        """``{layer.weight: W_base + scale * B @ A}`` for a sync's adapter tensors. On tpu the merges of all
        layers are recorded and run as one XLA program (DeferAndFuse), compiled once per model."""
        import torchtpu

        out = {}
        with torch.no_grad(), torchtpu.execution_mode("defer_and_fuse"):
            for n, w in self.base.items():
                a = adapters[f"{self.PREFIX}{n}.lora_A.weight"].to(w.device, torch.float32)
                b = adapters[f"{self.PREFIX}{n}.lora_B.weight"].to(w.device, torch.float32)
                out[f"{n}.weight"] = (w.float() + self.spec.scale * (b @ a)).to(w.dtype)
        for n, p in self.full.items():
            out[n] = adapters[f"{self.PREFIX}{n}"].to(p.device, p.dtype)
        return out

    def unknown(self, adapters: dict) -> Optional[str]:
        extra = sorted(set(adapters) - set(self.reference()))
        return extra[0] if extra else None
