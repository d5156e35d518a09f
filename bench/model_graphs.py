"""Real models as planning problems: capture on the meta device, annotate for a fixed device.

Every model is built under ``torch.device("meta")`` (no memory, any size) and annotated with the
analytic (roofline) cost model for :data:`REFERENCE`, an A100-80GB, so the graphs and therefore the
plans are the same on every machine. Device sets: ``k`` identical A100s, or (heterogeneous) ``k/2``
A100s and ``k/2`` devices at half the speed with 16 GiB, the solver choosing which device runs
each stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import fxsplit.models as zoo
from fxsplit.api import analyze
from fxsplit.ir import CondensedGraph, DeviceSpec, GiB

REFERENCE = DeviceSpec.preset("a100")
SLOW = REFERENCE.with_(speed=0.5, memory_bytes=16 * GiB, kind="slow")
BATCH = 8

_BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=512)
_VIT_BASE = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, num_labels=1000)
_GPT2 = dict(vocab_size=50257, n_positions=1024)


def _zoo(name: str, size: str) -> Callable[[], Any]:
    return lambda: zoo.get(name, size=size, batch_size=BATCH, device="meta")


def _hf(name: str, seq_len: int = 128, **config: Any) -> Callable[[], Any]:
    def build() -> Any:
        with torch.device("meta"):
            return zoo.hf(name, batch_size=BATCH, seq_len=seq_len, **config)

    return build


#: name -> (builder, description). Zoo models at their ``small`` size; Hugging Face models at
#: their published shapes (BERT-base, GPT-2 small and XL, ViT-B/16) and a Llama-7B-shaped model
#: cut to 8 layers (the full 32 layers are in ``planning_memory.py``).
MODELS: dict[str, tuple[Callable[[], Any], str]] = {
    "mlp": (_zoo("mlp", "small"), "zoo mlp (small)"),
    "resnet": (_zoo("resnet", "small"), "zoo resnet (small)"),
    "gpt": (_zoo("gpt", "small"), "zoo gpt (small)"),
    "unet": (_zoo("unet", "small"), "zoo unet (small)"),
    "inception": (_zoo("inception", "small"), "zoo inception (small)"),
    "dag": (_zoo("dag", "small"), "zoo random DAG (small)"),
    "bert": (_hf("bert", 128, **_BERT_BASE), "BERT-base, seq 128"),
    "gpt2-12": (_hf("gpt2", 1024, n_layer=12, n_embd=768, n_head=12, **_GPT2), "GPT-2 small (12 layers), seq 1024"),
    "gpt2-48": (_hf("gpt2", 1024, n_layer=48, n_embd=1600, n_head=25, **_GPT2), "GPT-2 XL (48 layers), seq 1024"),
    "vit": (_hf("vit", **_VIT_BASE), "ViT-B/16, 224x224"),
    "llama": (_hf("llama", 2048, preset="7b", num_hidden_layers=8), "Llama-7B shape, 8 layers, seq 2048"),
}
QUICK_MODELS = {
    "gpt-tiny": (_zoo("gpt", "tiny"), "zoo gpt (tiny)"),
    "resnet-tiny": (_zoo("resnet", "tiny"), "zoo resnet (tiny)"),
}


def capture_graph(name: str, build: Callable[[], Any]) -> tuple[CondensedGraph, float]:
    """The condensed graph of a model (whole-batch costs on :data:`REFERENCE`) and the capture seconds."""
    start = time.perf_counter()
    case = build()
    ins = analyze(case.model, case.example_inputs, case.example_kwargs or None, device=REFERENCE, name=name)
    return ins.condensed.graph, time.perf_counter() - start


def device_set(k: int, hetero: bool) -> tuple[DeviceSpec, ...]:
    """``k`` A100s, or ``k/2`` A100s then ``k/2`` half-speed 16 GiB devices."""
    return tuple(
        REFERENCE.with_(name=f"a100:{i}") if not hetero or i < k // 2 else SLOW.with_(name=f"slow:{i}")
        for i in range(k)
    )
