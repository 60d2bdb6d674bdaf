"""LoRA learners: ``peft`` adapters on a Hugging Face policy, adapter-only weight sync, merged rollouts.

The learner trains a ``peft`` LoRA model (:meth:`LoraSpec.apply`: the base weights frozen, only the
adapters' ``lora_A`` / ``lora_B`` trained); a weight sync sends the adapter tensors only
(:func:`adapter_state_dict`: ``2 * rank * (in + out)`` numbers per target layer instead of
``in * out``). A rollout worker keeps a plain model (its KV cache, compiled decode steps and
quantization stay as they are) and merges each update into it: ``W = W_base + alpha / rank * B @ A``
from a copy of the base weights of the target layers it took at start (:class:`AdapterMerger`).
Both sides load the same base checkpoint, which LoRA training never changes.
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

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` as a peft LoRA model (base weights frozen, adapters trainable; ``B`` starts at 0, so
        the output is the base model's)."""
        from peft import LoraConfig, get_peft_model

        layers = self.target_layers(model)
        config = LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=layers, lora_dropout=0.0,
                            bias="none")
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
    return hf.save_hf(host.merge_and_unload(), tokenizer, out_dir)


class AdapterMerger:
    """Merges adapter updates into a plain model in place: ``W = W_base + scale * B @ A`` per target layer,
    from copies of the base weights taken at construction."""

    PREFIX = "base_model.model."

    def __init__(self, model: nn.Module, spec: LoraSpec):
        self.spec = spec
        self.layers = spec.target_layers(model)
        with torch.no_grad():
            self.base = {n: model.get_submodule(n).weight.detach().clone() for n in self.layers}

    def reference(self) -> dict:
        """Meta tensors of the update's names, dtypes and shapes (what a sync must send)."""
        out = {}
        for n, w in self.base.items():
            out[f"{self.PREFIX}{n}.lora_A.weight"] = torch.empty((self.spec.rank, w.shape[1]), dtype=w.dtype,
                                                                 device="meta")
            out[f"{self.PREFIX}{n}.lora_B.weight"] = torch.empty((w.shape[0], self.spec.rank), dtype=w.dtype,
                                                                 device="meta")
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
        return out

    def unknown(self, adapters: dict) -> Optional[str]:
        extra = sorted(set(adapters) - set(self.reference()))
        return extra[0] if extra else None
