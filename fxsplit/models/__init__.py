"""Built-in models: a zoo of real architectures, Hugging Face builders, random DAG modules.

Every builder returns a :class:`ModelCase`: the module with example inputs, a synthetic batch
generator and a loss, deterministic for a seed. ``transformers`` is imported only by :func:`hf`.

Example:
    >>> import fxsplit.models as zoo
    >>> sorted(zoo.list_models())[:3]
    ['dag', 'gpt', 'inception']
    >>> case = zoo.get("resnet", blocks=(1,))
    >>> inputs, target = case.make_batch(2, seed=0)
    >>> case.loss_fn(case.model(*inputs), target).backward()
"""

from __future__ import annotations

from fxsplit.models.case import SIZES, ModelCase, primary_tensor
from fxsplit.models.dag import DagNode, DagSpec, build_dag_module, random_dag_spec
from fxsplit.models.hf import HF_MODELS, LLAMA_PRESETS, hf, list_hf_models, llama_config
from fxsplit.models.registry import get, list_models

__all__ = [
    "SIZES",
    "HF_MODELS",
    "LLAMA_PRESETS",
    "ModelCase",
    "DagNode",
    "DagSpec",
    "build_dag_module",
    "get",
    "hf",
    "list_hf_models",
    "list_models",
    "llama_config",
    "primary_tensor",
    "random_dag_spec",
]
