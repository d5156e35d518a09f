"""A GPT-style decoder: token and position embeddings, pre-LN blocks, tied LM head.

References:
    Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019, §2.3
    (pre-LayerNorm blocks, a final LayerNorm); Press and Wolf, "Using the Output Embedding to
    Improve Language Models", EACL 2017 (tying the LM head to the token embedding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fxsplit.errors import ConfigError
from fxsplit.models.case import Batch, ModelCase, batch_maker, next_token_loss, seeded

__all__ = ["GptConfig", "CausalSelfAttention", "Block", "GPT", "PRESETS", "make_case"]


@dataclass(frozen=True)
class GptConfig:
    """Sizes of a :class:`GPT`.

    Attributes:
        vocab_size: Number of token ids.
        max_seq_len: Longest sequence the position embedding and causal mask cover.
        seq_len: Sequence length of the example inputs (<= ``max_seq_len``).
        layers: Number of decoder blocks.
        width: Model width ``d_model``.
        heads: Attention heads; must divide ``width``.
        mlp_ratio: Hidden width of the MLP over ``width``.
        sdpa: Use ``F.scaled_dot_product_attention(is_causal=True)`` instead of explicit
            ``matmul -> masked_fill -> softmax -> matmul`` (explicit is finer-grained to split).
    """

    vocab_size: int = 128
    max_seq_len: int = 32
    seq_len: int = 16
    layers: int = 2
    width: int = 32
    heads: int = 2
    mlp_ratio: int = 4
    sdpa: bool = False

    def validate(self) -> None:
        """Raise :class:`ConfigError` for non-positive sizes or inconsistent ones."""
        for name in ("vocab_size", "max_seq_len", "seq_len", "layers", "width", "heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GptConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ConfigError(f"GptConfig.heads={self.heads} must divide width={self.width}")
        if self.seq_len > self.max_seq_len:
            raise ConfigError(
                f"GptConfig.seq_len={self.seq_len} exceeds max_seq_len={self.max_seq_len}"
            )


PRESETS = {
    "tiny": GptConfig(),
    "small": GptConfig(vocab_size=1024, max_seq_len=128, seq_len=64, layers=4, width=128, heads=4),
    # GPT-2 small (124M parameters); the example sequence is shorter than the context.
    "base": GptConfig(
        vocab_size=50257, max_seq_len=1024, seq_len=128, layers=12, width=768, heads=12
    ),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` attends to positions ``<= t``.

    Args:
        config: The sizes.

    Shape:
        ``x [batch, seq, width] -> [batch, seq, width]``.
    """

    causal_mask: torch.Tensor  # [1, 1, max_seq_len, max_seq_len], True where attention is allowed

    def __init__(self, config: GptConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.width // config.heads
        self.sdpa = config.sdpa
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        mask = torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask.view(1, 1, *mask.shape), persistent=False)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, width] -> [batch, heads, seq, head_dim]``."""
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x [batch, seq, width]``."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x [batch, seq, width]
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            seq = x.size(1)
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            # narrow, not [:seq]: symbolic_trace cannot slice a buffer with a traced size.
            mask = self.causal_mask.narrow(2, 0, seq).narrow(3, 0, seq)
            scores = scores.masked_fill(mask.logical_not(), float("-inf"))
            y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Pre-LN decoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Args:
        config: The sizes.

    Shape:
        ``x [batch, seq, width] -> [batch, seq, width]``.
    """

    def __init__(self, config: GptConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.width
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, hidden), nn.GELU(), nn.Linear(hidden, config.width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x [batch, seq, width]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style language model whose LM head shares its weight with the token embedding.

    Args:
        config: The sizes.

    Shape:
        ``tokens [batch, seq] (int64) -> logits [batch, seq, vocab_size]``.
    """

    def __init__(self, config: GptConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.width)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.width)
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.layers)))
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``tokens [batch, seq]`` to next-token logits ``[batch, seq, vocab_size]``."""
        pos = torch.arange(tokens.size(1), device=tokens.device)  # [seq]
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        return self.lm_head(self.ln_f(self.blocks(x)))


def _init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases (keeps the tied logits near 0)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def make_case(config: GptConfig, *, seed: int = 0, batch_size: int = 2) -> ModelCase:
    """Build a :class:`GPT` with a next-token prediction task on random tokens.

    Args:
        config: The sizes.
        seed: Seed of the weights and of the example batch.
        batch_size: Batch size of the example inputs.

    Returns:
        The model case; ``make_batch`` returns ``tokens [batch, seq_len]`` and the same sequence
        shifted by one as the target.
    """
    with seeded(seed):
        model = GPT(config)

    def draw(gen: torch.Generator, batch_size: int) -> Batch:
        shape = (batch_size, config.seq_len + 1)
        tokens = torch.randint(0, config.vocab_size, shape, generator=gen, device="cpu")
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    make_batch = batch_maker(model, draw)
    return ModelCase(
        name="gpt",
        model=model,
        example_inputs=make_batch(batch_size, seed)[0],
        make_batch=make_batch,
        loss_fn=next_token_loss,
        description=(
            f"GPT layers={config.layers} width={config.width} heads={config.heads} "
            f"vocab={config.vocab_size} seq={config.seq_len} (tied head)"
        ),
        config=config,
    )
