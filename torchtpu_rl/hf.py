"""Hugging Face checkpoints as RL models: policy, reference, critic, tokenizer, reward model.

Everything here reads and writes *local* directories with ``transformers``
(nothing is downloaded):

- :func:`load_policy`: ``AutoModelForCausalLM.from_pretrained(dir)`` in float32 or
  bfloat16 on ``device``. The reference policy is the same call again; the PPO critic is
  :meth:`ValueModel.from_policy` of it (:func:`load_critic`). A directory that is not a
  causal LM (no ``config.json``, a config ``AutoModelForCausalLM`` does not know, a
  sequence-classification checkpoint, missing weights) is refused naming the directory and
  what it holds.
- :func:`load_tokenizer`: ``AutoTokenizer.from_pretrained(dir)``; a tokenizer without a pad
  token gets pad = eos (one warning per directory), as TRL and verl do.
- :func:`load_reward_model`: ``AutoModelForSequenceClassification`` with one label;
  :func:`reward_scores` scores (prompt, completion) texts at the last real token, in
  bucketed batches (``torchtpu.bucketing``).
- :func:`save_hf`: ``save_pretrained`` (safetensors) plus the tokenizer, from a model on any
  device (tensors are moved to the host first), so plain ``transformers`` on CPU reloads it.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence

import torch

__all__ = [
    "causal_lm_config",
    "generation_eos_ids",
    "load_critic",
    "load_policy",
    "load_reward_model",
    "load_tokenizer",
    "check_tokenizer_fits",
    "model_fingerprint",
    "resolve_dtype",
    "reward_model_config",
    "reward_scores",
    "save_hf",
    "check_weights",
]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_pad_warned: set = set()


def resolve_dtype(dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` (or the torch dtypes) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")


def _model_dir(model_dir, what: str) -> str:
    if not isinstance(model_dir, (str, os.PathLike)):
        raise TypeError(f"{what}: model_dir must be a path, not {type(model_dir).__name__}")
    d = os.fspath(model_dir)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{what}: model directory {d!r} does not exist (or is not a directory)")
    if not os.path.isfile(os.path.join(d, "config.json")):
        found = sorted(os.listdir(d))[:12]
        raise ValueError(f"{what}: {d!r} is not a Hugging Face model directory: it has no config.json "
                         f"(found: {found or 'nothing'})")
    return d


def _config(d: str, what: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(d)
    except Exception as e:  # noqa: BLE001 - re-raised naming the directory
        raise ValueError(f"{what}: cannot read the config of {d!r}: {type(e).__name__}: {e}") from e


def _describe(cfg) -> str:
    return f"model_type {getattr(cfg, 'model_type', None)!r}, architectures {getattr(cfg, 'architectures', None)}"


def _from_pretrained(auto_cls, d: str, dtype: torch.dtype, what: str):
    try:
        model, info = auto_cls.from_pretrained(d, dtype=dtype, output_loading_info=True)
    except OSError as e:
        found = sorted(os.listdir(d))[:12]
        raise ValueError(f"{what}: cannot load the weights of {d!r} (found: {found}): {e}") from e
    missing = list(info.get("missing_keys") or [])
    if missing:
        # transformers fills missing weights with random values: a silent wrong model, refused here
        raise ValueError(f"{what}: {d!r} has no weights for {len(missing)} parameter(s) of "
                         f"{type(model).__name__} (e.g. {missing[:4]}); it is not a checkpoint of this kind of "
                         f"model ({_describe(model.config)})")
    return model


def causal_lm_config(model_dir, what: str = "causal_lm_config"):
    """The config of a causal-LM checkpoint directory; anything else is refused naming the directory
    and what it holds (cheap: reads config.json only)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    d = _model_dir(model_dir, what)
    cfg = _config(d, what)
    archs = list(getattr(cfg, "architectures", None) or [])
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{what}: {d!r} is not a causal language model: its config has {_describe(cfg)}, which "
                         f"AutoModelForCausalLM cannot load")
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        raise ValueError(f"{what}: {d!r} is not a causal language model: it was saved as {archs}, not a *ForCausalLM "
                         f"(a reward, classifier or masked LM has no next-token head to sample from)")
    return cfg


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def check_weights(model_dir, what: str = "check_weights") -> list:
    """The directory's weight files, each read far enough to know it is whole: a safetensors header must
    cover the file, a PyTorch zip must have its central directory (a copy cut short loses the end).
    Cheap (no tensor is read); a torn or missing file is refused naming it, before any actor loads it."""
    import zipfile

    d = _model_dir(model_dir, what)
    files = sorted(f for f in os.listdir(d) if f.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(d, f)))
    if not files:
        raise ValueError(f"{what}: {d!r} holds no weight files (*.safetensors or *.bin; found: "
                         f"{sorted(os.listdir(d))[:12]})")
    for f in files:
        path = os.path.join(d, f)
        try:
            if f.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, "pt") as fh:
                    fh.keys()
            elif not zipfile.is_zipfile(path):
                raise ValueError("not a complete PyTorch zip archive")
        except Exception as e:  # noqa: BLE001 - re-raised naming the file
            raise ValueError(f"{what}: the weight file {path!r} is torn or unreadable ({type(e).__name__}: {e}); "
                             "copy or download it again") from e
    return files


def generation_eos_ids(model_dir) -> list:
    """The end-of-sequence ids a checkpoint declares (config and generation_config.json; chat models
    often have several, e.g. an end-of-turn token besides eos)."""
    from transformers import GenerationConfig

    d = os.fspath(model_dir)
    ids = []
    sources = [_config(_model_dir(d, "generation_eos_ids"), "generation_eos_ids")]
    if os.path.isfile(os.path.join(d, "generation_config.json")):
        sources.append(GenerationConfig.from_pretrained(d))
    for src in sources:
        e = getattr(src, "eos_token_id", None)
        for i in (e if isinstance(e, (list, tuple)) else [e]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def load_policy(model_dir, dtype="float32", device="tpu"):
    """A causal LM from a local checkpoint directory, in ``dtype``, on ``device``, in train mode.

    The reference policy is a second call; every Ray actor makes its own from a picklable
    ``functools.partial(load_policy, model_dir, dtype=..., device="cpu")``."""
    from transformers import AutoModelForCausalLM

    what = "load_policy"
    causal_lm_config(model_dir, what)
    model = _from_pretrained(AutoModelForCausalLM, os.fspath(model_dir), resolve_dtype(dtype), what)
    model.train()
    return model.to(device) if device is not None else model


def load_critic(model_dir, dtype="float32", device="tpu"):
    """A PPO critic whose trunk is the checkpoint's causal LM (value head at zero), as verl and
    OpenRLHF initialize it. (The :class:`~torchtpu_rl.learner.Learner` makes the same critic from
    its policy when none is given.)"""
    from .policy import ValueModel

    trunk = load_policy(model_dir, dtype, device="cpu")
    critic = ValueModel(trunk).to(trunk.dtype)
    return critic.to(device) if device is not None else critic


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer; pad = eos (with one warning per directory) when it has no pad token."""
    from transformers import AutoTokenizer

    what = "load_tokenizer"
    if not isinstance(model_dir, (str, os.PathLike)) or not os.path.isdir(os.fspath(model_dir)):
        raise FileNotFoundError(f"{what}: tokenizer directory {model_dir!r} does not exist")
    d = os.fspath(model_dir)
    if not any(os.path.isfile(os.path.join(d, f)) for f in _TOKENIZER_FILES):
        # AutoTokenizer would build an empty tokenizer from config.json alone, and the data would get the blame
        raise ValueError(f"{what}: {d!r} has no tokenizer files (none of {list(_TOKENIZER_FILES)}; found: "
                         f"{sorted(os.listdir(d))[:12]}); save the tokenizer there (tokenizer.save_pretrained)")
    try:
        if _declared_tokenizer_class(d) in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            # a plain tokenizers-library tokenizer (e.g. one trained with `tokenizers`): load that class.
            # AutoTokenizer would swap in the model type's class (Qwen2Tokenizer, ...), whose defaults add
            # special tokens the checkpoint never had (Qwen2's "<|endoftext|>" pad, a new id).
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(d)
        else:
            tok = AutoTokenizer.from_pretrained(d)
    except Exception as e:  # noqa: BLE001 - re-raised naming the directory
        found = sorted(os.listdir(d))[:12]
        raise ValueError(f"{what}: cannot load a tokenizer from {d!r} (found: {found}): {type(e).__name__}: {e}") from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"{what}: the tokenizer of {d!r} has neither a pad nor an eos token; add one "
                             "(tokenizer.add_special_tokens) and save it again")
        tok.pad_token = tok.eos_token
        if d not in _pad_warned:
            _pad_warned.add(d)
            warnings.warn(f"tokenizer of {d!r} has no pad token: using eos {tok.eos_token!r} "
                          f"(id {tok.eos_token_id}) as pad", UserWarning, stacklevel=2)
    return tok


def _declared_tokenizer_class(d: str) -> Optional[str]:
    import json

    try:
        with open(os.path.join(d, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def check_tokenizer_fits(tokenizer, model, model_dir="") -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table (on tpu an out-of-range
    embedding index does not raise: it would silently read garbage)."""
    cfg = getattr(model, "config", model)
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer{f' of {model_dir!r}' if model_dir else ''} has {len(tokenizer)} tokens, more "
                         f"than the model's vocab_size {vocab}: token ids >= {vocab} have no embedding")


def model_fingerprint(model_dir) -> dict:
    """What identifies a checkpoint's model for resuming: architecture and shapes from its config."""
    d = _model_dir(model_dir, "model_fingerprint")
    cfg = _config(d, "model_fingerprint")
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "tie_word_embeddings")
    out = {k: getattr(cfg, k, None) for k in keys}
    out["architectures"] = list(getattr(cfg, "architectures", None) or [])
    return out


# ------------------------------------------------------------------ reward models
def load_reward_model(model_dir, dtype="float32", device="tpu"):
    """An ``AutoModelForSequenceClassification`` with one label (the reward) from a local directory,
    in eval mode on ``device``."""
    from transformers import AutoModelForSequenceClassification

    what = "load_reward_model"
    reward_model_config(model_dir, what)
    model = _from_pretrained(AutoModelForSequenceClassification, os.fspath(model_dir), resolve_dtype(dtype), what)
    return model.to(device).eval()


def reward_model_config(model_dir, what: str = "reward_model_config"):
    """The config of a one-label sequence-classification directory; anything else is refused naming the
    directory and what it holds (reads config.json only)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    d = _model_dir(model_dir, what)
    cfg = _config(d, what)
    archs = list(getattr(cfg, "architectures", None) or [])
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{what}: {d!r} is not a sequence-classification (reward) model: it was saved as {archs}")
    if type(cfg) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        raise ValueError(f"{what}: {d!r} is not a sequence-classification model: its config has {_describe(cfg)}, "
                         f"which AutoModelForSequenceClassification cannot load")
    if getattr(cfg, "num_labels", 1) != 1:
        raise ValueError(f"{what}: {d!r} has num_labels={cfg.num_labels}; a reward model has one output (num_labels=1)")
    return cfg


def _token_scores(model, ids, mask):
    """Per-token scores (B, T) of a decoder sequence classifier (backbone + ``score`` head), or
    None for a model that pools on its own (e.g. an encoder's first token)."""
    head = getattr(model, "score", None)
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(head, torch.nn.Linear) or backbone is None:
        return None
    h = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    return head(h)[..., 0]


def reward_scores(model, tokenizer, prompts: Sequence[str], completions: Sequence[str], *, device="tpu",
                  length_buckets=None, batch_buckets=None) -> list:
    """The reward model's score of each ``prompt + completion`` text at its last real token.

    Texts are tokenized with the reward model's own tokenizer, right-padded (so positions
    count from 0 as in training) to bucketed lengths and batch sizes: one program per
    (batch bucket, length bucket). Decoder classifiers (Llama, Qwen2, ...) are read at the last
    non-pad token from the attention mask, whatever the pad id; other classifiers pool as
    they were trained to."""
    from torchtpu import bucketing
    from torchtpu.bucketing import BucketPolicy

    if len(prompts) != len(completions):
        raise ValueError(f"reward_scores: {len(prompts)} prompts and {len(completions)} completions")
    if not prompts:
        return []
    cfg = model.config
    top = getattr(cfg, "max_position_embeddings", None) or 4096
    length_buckets = length_buckets or BucketPolicy.pow2(16, max(16, top), name="reward_length")
    batch_buckets = batch_buckets or BucketPolicy.pow2(1, 64, name="reward_batch").with_overflow("split")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seqs = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = tokenizer(p + c, add_special_tokens=True)["input_ids"]
        if not ids:
            ids = [pad_id]
        if len(ids) > length_buckets.largest:
            raise ValueError(f"reward_scores: sample {i} has {len(ids)} tokens, more than the reward model's "
                             f"largest length bucket {length_buckets.largest}")
        seqs.append(ids)
    out = []
    with torch.no_grad():
        for start, n, _ in batch_buckets.chunks(len(seqs)):
            pb = bucketing.pad_sequences(seqs[start:start + n], length_buckets, batch_buckets, value=pad_id,
                                         dtype=torch.int64)
            ids, mask = pb.values.to(device), pb.attention_mask.long().to(device)
            with pb.scope():
                tok = _token_scores(model, ids, mask)
                if tok is not None:
                    last = (pb.lengths.clamp(min=1) - 1).to(device)
                    vals = tok.float().gather(1, last[:, None]).squeeze(1)
                else:
                    vals = model(input_ids=ids, attention_mask=mask).logits.float()[:, 0]
                vals = vals.cpu()
            out.extend(float(v) for v in vals[:n])
    return out


# ------------------------------------------------------------------ saving
def save_hf(policy, tokenizer, out_dir) -> str:
    """Write ``policy`` (a ``transformers`` model on any device) with ``save_pretrained``
    (safetensors) and ``tokenizer`` (when given) to ``out_dir``; returns ``out_dir``."""
    from transformers import PreTrainedModel

    if not isinstance(policy, PreTrainedModel):
        raise TypeError(f"save_hf: policy must be a transformers PreTrainedModel, not {type(policy).__name__}")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    # host copies: safetensors reads bytes through host memory, and tpu tensors have none. Tied
    # weights (one tensor under two names, e.g. embeddings and lm_head) are written once, under
    # the first name, as transformers does: the reloaded model ties them again from its config.
    state, seen = {}, set()
    for k, v in policy.state_dict().items():
        key = (v.data_ptr(), tuple(v.shape), v.dtype)
        if key in seen:
            continue
        seen.add(key)
        state[k] = v.detach().cpu().contiguous()
    policy.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
