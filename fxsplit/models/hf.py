"""Hugging Face models built from their config classes with random weights, never downloading.

``transformers`` is imported when a model is built, not at ``import fxsplit``. Every model is
built from a config object (no ``from_pretrained``), so nothing touches the network and
``HF_HUB_OFFLINE=1`` changes nothing. Dropout probabilities are 0.0 so that outputs are
deterministic in training mode, and ``use_cache=False`` where the model has a KV cache.

Under ``torch.export.export(strict=False)`` every model here returns its Hugging Face
``ModelOutput`` (``MaskedLMOutput``, ``CausalLMOutputWithCrossAttentions``,
``ImageClassifierOutput``, ``CausalLMOutputWithPast``, ``Seq2SeqLMOutput``), a pytree whose
``"logits"`` entry :func:`fxsplit.models.case.primary_tensor` reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.models.case import (
    Batch,
    ModelCase,
    batch_maker,
    cross_entropy_loss,
    next_token_loss,
    seeded,
)

__all__ = ["HF_MODELS", "LLAMA_PRESETS", "hf", "llama_config", "list_hf_models"]

logger = logging.getLogger(__name__)

_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}

LLAMA_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "tiny": dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ),
    # Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023, Table 2.
    "7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
    ),
    "13b": dict(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
    ),
    # Touvron et al., "Llama 2", 2023: grouped-query attention with 8 key/value heads.
    "70b": dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
    ),
}  # fmt: skip
"""Llama config sizes: ``tiny`` for tests, and the shapes of Llama-7B/13B (6.7e9/13e9 parameters)
and Llama-2-70B (6.9e10), to build under ``torch.device("meta")``."""


@dataclass(frozen=True)
class _HfSpec:
    """How to build and feed one Hugging Face model family."""

    config_class: str
    model_class: str
    defaults: Mapping[str, Any]
    draw: Callable[[Any, int], Callable[[torch.Generator, int], Batch]]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    kwargs: Callable[[tuple[torch.Tensor, ...]], dict[str, torch.Tensor]] = lambda inputs: {}


def _tokens(vocab: int, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Random token ids ``[batch, seq]`` (int64, CPU)."""
    return torch.randint(0, vocab, (batch, seq), generator=gen, device="cpu")


def _causal_lm_draw(config: Any, seq_len: int) -> Callable[[torch.Generator, int], Batch]:
    """``(input_ids [batch, seq_len],)`` and the next tokens ``[batch, seq_len]`` as target."""

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        tokens = _tokens(config.vocab_size, batch_size, seq_len + 1, gen)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    return draw


def _masked_lm_draw(config: Any, seq_len: int) -> Callable[[torch.Generator, int], Batch]:
    """``(input_ids [batch, seq_len],)`` and random labels ``[batch, seq_len]`` (MLM on all)."""

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        ids = _tokens(config.vocab_size, batch_size, seq_len, gen)
        return (ids,), _tokens(config.vocab_size, batch_size, seq_len, gen)

    return draw


def _image_draw(config: Any, seq_len: int) -> Callable[[torch.Generator, int], Batch]:
    """``(pixel_values [batch, channels, size, size],)`` and labels ``[batch]``."""

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        shape = (batch_size, config.num_channels, config.image_size, config.image_size)
        pixels = torch.randn(*shape, generator=gen, device="cpu")
        labels = torch.randint(0, config.num_labels, (batch_size,), generator=gen, device="cpu")
        return (pixels,), labels

    return draw


def _seq2seq_draw(config: Any, seq_len: int) -> Callable[[torch.Generator, int], Batch]:
    """``(input_ids, attention_mask, decoder_input_ids)`` and decoder labels ``[batch, seq/2]``.

    The decoder inputs are the labels shifted right behind ``decoder_start_token_id`` (teacher
    forcing), as ``T5ForConditionalGeneration`` does when given ``labels``.
    """

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        ids = _tokens(config.vocab_size, batch_size, seq_len, gen)
        labels = _tokens(config.vocab_size, batch_size, max(seq_len // 2, 1), gen)
        start = torch.full((batch_size, 1), config.decoder_start_token_id, device="cpu")
        decoder_ids = torch.cat([start, labels[:, :-1]], dim=1)
        mask = torch.ones(ids.shape, dtype=torch.long, device="cpu")
        return (ids, mask, decoder_ids), labels

    return draw


def _attention_mask_kwargs(inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """``{"attention_mask": ones like input_ids}``: exercises keyword inputs, changes nothing."""
    return {"attention_mask": torch.ones_like(inputs[0], device=inputs[0].device)}


_SPECS: Mapping[str, _HfSpec] = {
    "bert": _HfSpec(
        "BertConfig", "BertForMaskedLM",
        dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=128, max_position_embeddings=64, **_NO_DROPOUT),
        _masked_lm_draw, next_token_loss,
        kwargs=_attention_mask_kwargs,
    ),
    "gpt2": _HfSpec(
        "GPT2Config", "GPT2LMHeadModel",
        dict(vocab_size=128, n_embd=64, n_layer=2, n_head=2, n_positions=64, use_cache=False,
             bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        _causal_lm_draw, next_token_loss,
    ),
    "vit": _HfSpec(
        "ViTConfig", "ViTForImageClassification",
        dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=2, intermediate_size=128, num_labels=10, **_NO_DROPOUT),
        _image_draw, cross_entropy_loss,
    ),
    "llama": _HfSpec(
        "LlamaConfig", "LlamaForCausalLM",
        dict(LLAMA_PRESETS["tiny"], use_cache=False, attention_dropout=0.0,
             bos_token_id=0, eos_token_id=0, pad_token_id=None),
        _causal_lm_draw, next_token_loss,
    ),
    "t5": _HfSpec(
        "T5Config", "T5ForConditionalGeneration",
        dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
             num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
             pad_token_id=0, eos_token_id=1),
        _seq2seq_draw, next_token_loss,
    ),
}  # fmt: skip

HF_MODELS: tuple[str, ...] = tuple(_SPECS)
"""Names :func:`hf` accepts."""


def list_hf_models() -> list[str]:
    """Names :func:`hf` accepts, sorted."""
    return sorted(_SPECS)


def _transformers() -> Any:
    """Import ``transformers`` or raise :class:`ConfigError` saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "Hugging Face models need the transformers package: pip install 'fxsplit[hf]'"
        ) from exc
    return transformers


def _make_config(spec: _HfSpec, overrides: Mapping[str, Any], attn_implementation: str) -> Any:
    """Build the config object; refuse overrides that are not attributes of the config class."""
    config_class = getattr(_transformers(), spec.config_class)
    known = config_class()
    unknown = sorted(k for k in overrides if not hasattr(known, k))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for {spec.config_class}; "
            f"see the transformers documentation of {spec.config_class} for its fields"
        )
    return config_class(**{**spec.defaults, **overrides}, attn_implementation=attn_implementation)


def llama_config(
    preset: str = "tiny", *, attn_implementation: str = "eager", **overrides: Any
) -> Any:
    """A ``transformers.LlamaConfig`` of a preset size, with no cache and no dropout.

    Args:
        preset: A key of :data:`LLAMA_PRESETS` (``"tiny"``, ``"7b"``, ``"13b"``, ``"70b"``).
        attn_implementation: ``"eager"`` (explicit matmul/softmax) or ``"sdpa"``.
        **overrides: ``LlamaConfig`` fields to replace, e.g. ``num_hidden_layers=4``.

    Returns:
        The config.

    Raises:
        ConfigError: Unknown preset, unknown field, or transformers is not installed.

    Example:
        >>> llama_config("7b").hidden_size
        4096
    """
    if preset not in LLAMA_PRESETS:
        raise ConfigError(f"unknown llama preset {preset!r}; known: {', '.join(LLAMA_PRESETS)}")
    merged = {**LLAMA_PRESETS[preset], **overrides}
    return _make_config(_SPECS["llama"], merged, attn_implementation)


def hf(
    name: str,
    *,
    preset: str | None = None,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 16,
    attn_implementation: str = "eager",
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> ModelCase:
    """Build a Hugging Face model with random weights from a small config, in training mode.

    Build under ``with torch.device("meta"):`` to get a model of any size without allocating it.

    Args:
        name: One of :data:`HF_MODELS`: ``bert`` (BertForMaskedLM), ``gpt2`` (GPT2LMHeadModel),
            ``vit`` (ViTForImageClassification, 32x32 images), ``llama`` (LlamaForCausalLM),
            ``t5`` (T5ForConditionalGeneration). A ``"hf:"`` prefix is accepted.
        preset: Llama only: a key of :data:`LLAMA_PRESETS`, e.g. ``"7b"``.
        seed: Seed of the weights and of the example batch.
        batch_size: Batch size of the example inputs.
        seq_len: Sequence length of the example inputs (token models), in tokens.
        attn_implementation: ``"eager"`` or ``"sdpa"``; both export with ``strict=False``.
        dtype: Cast the model to this dtype after building (``None`` keeps float32).
        **config_overrides: Fields of the model's config class, e.g. ``num_hidden_layers=4``.

    Returns:
        The model case. Its ``loss_fn`` reads ``output.logits``: masked-LM and next-token cross
        entropy for the token models, classification cross entropy for ViT. BERT's
        ``example_kwargs`` holds an all-ones ``attention_mask``; the others have none.

    Raises:
        ConfigError: Unknown name, preset or config field, or transformers is not installed.
    """
    key = name.removeprefix("hf:")
    if key not in _SPECS:
        raise ConfigError(f"unknown Hugging Face model {name!r}; known: {', '.join(HF_MODELS)}")
    if preset is not None and key != "llama":
        raise ConfigError(f"preset= applies to llama only, got preset={preset!r} for {key!r}")
    spec = _SPECS[key]
    if key == "llama":
        config = llama_config(preset or "tiny", attn_implementation=attn_implementation,
                              **config_overrides)  # fmt: skip
    else:
        config = _make_config(spec, config_overrides, attn_implementation)
    model_class = getattr(_transformers(), spec.model_class)
    with seeded(seed):
        model: nn.Module = model_class(config)
    if dtype is not None:
        model = model.to(dtype)
    model.train()
    make_batch = batch_maker(model, spec.draw(config, seq_len))
    inputs = make_batch(batch_size, seed)[0]
    logger.debug("built %s from %s", spec.model_class, spec.config_class)
    return ModelCase(
        name=f"hf:{key}",
        model=model,
        example_inputs=inputs,
        example_kwargs=spec.kwargs(inputs),
        make_batch=make_batch,
        loss_fn=spec.loss_fn,
        description=_describe(spec.model_class, config),
        config=config,
    )


def _describe(model_class: str, config: Any) -> str:
    """One line: class, layers, width, heads, vocabulary."""
    parts = [model_class]
    for label, attr in (("layers", "num_hidden_layers"), ("width", "hidden_size"),
                        ("heads", "num_attention_heads"), ("vocab", "vocab_size")):  # fmt: skip
        value = getattr(config, attr, None)
        if value is not None:
            parts.append(f"{label}={value}")
    return " ".join(parts)
