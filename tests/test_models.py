"""Tests of the built-in model zoo, the Hugging Face builders and the random DAG modules."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

import fxsplit.models as zoo
from fxsplit.errors import ConfigError
from fxsplit.models.dag import DagNode, DagSpec, build_dag_module, random_dag_spec

ZOO = sorted(zoo.list_models())


def _assert_same_outputs(expected: object, actual: object) -> None:
    """Every tensor leaf of ``actual`` equals the matching leaf of ``expected``."""
    want, got = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    assert len(want) == len(got), f"{len(want)} outputs expected, got {len(got)}"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}")


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- registry


def test_list_models_names_the_zoo() -> None:
    assert {"mlp", "resnet", "gpt", "unet", "inception", "dag"} <= set(zoo.list_models())


def test_unknown_model_raises_config_error_listing_known_names() -> None:
    with pytest.raises(
        ConfigError, match="unknown model 'nope'; known models: mlp, resnet, gpt.*hf:llama"
    ):
        zoo.get("nope")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size": "huge"}, "unknown size 'huge'"),
        ({"layerz": 3}, "unknown option.*layerz.*known options"),
        ({"width": 30, "heads": 4}, "heads=4 must divide width=30"),
        ({"seq_len": 64}, "seq_len=64 exceeds max_seq_len=32"),
    ],
)
def test_bad_gpt_options_raise_config_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        zoo.get("gpt", **kwargs)


def test_unet_image_size_must_divide_by_pool_factor() -> None:
    with pytest.raises(ConfigError, match="divisible by 2\\*\\*depth=4"):
        zoo.get("unet", image_size=18)


def test_make_batch_rejects_empty_batch() -> None:
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        zoo.get("mlp").make_batch(0, 0)


# ---------------------------------------------------------------- zoo models


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_trains_one_step(name: str) -> None:
    case = zoo.get(name)
    inputs, target = case.make_batch(3, seed=1)
    assert all(t.shape[0] == 3 for t in inputs)
    loss = case.loss_fn(case.model(*inputs), target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in case.model.named_parameters() if p.grad is None]
    assert not missing, f"{name}: parameters without gradient: {missing}"


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = zoo.get(name, seed=5), zoo.get(name, seed=5), zoo.get(name, seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    for (key, pa), pb in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), key
    _assert_same_outputs(a.make_batch(2, 9), b.make_batch(2, 9))
    pairs = zip(a.model.parameters(), c.model.parameters(), strict=False)
    assert any(not torch.equal(p, q) for p, q in pairs) or name == "dag"  # a dag may lack params


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_exports_and_traces_with_equal_outputs(name: str) -> None:
    case = zoo.get(name)
    case.model.eval()  # BatchNorm uses running stats: the three calls see the same function
    expected = case.model(*case.example_inputs)
    exported = torch.export.export(case.model, case.example_inputs, strict=False)
    _assert_same_outputs(expected, exported.module()(*case.example_inputs))
    traced = torch.fx.symbolic_trace(case.model)
    _assert_same_outputs(expected, traced(*case.example_inputs))


@pytest.mark.parametrize("name", ["resnet", "inception"])
def test_batchnorm_models_export_in_training_mode(name: str) -> None:
    case = zoo.get(name)
    expected = case.model(*case.example_inputs)  # training mode: batch statistics
    exported = torch.export.export(case.model, case.example_inputs, strict=False).module()
    bn = next(k for k, _ in exported.named_buffers() if k.endswith("running_mean"))
    before = exported.get_buffer(bn).clone()
    _assert_same_outputs(expected, exported(*case.example_inputs))
    assert not torch.equal(exported.get_buffer(bn), before), "running stats should update"


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_builds_runs_and_exports_on_meta(name: str) -> None:
    with torch.device("meta"):
        case = zoo.get(name)
    assert all(p.is_meta for p in case.model.parameters())
    assert all(t.is_meta for t in case.example_inputs)
    out = case.model(*case.example_inputs)
    assert all(t.is_meta for t in pytree.tree_leaves(out))
    torch.export.export(case.model, case.example_inputs, strict=False)


@pytest.mark.parametrize("size", zoo.SIZES)
@pytest.mark.parametrize("name", ZOO)
def test_every_size_builds_on_meta(name: str, size: str) -> None:
    case = zoo.get(name, size, device="meta")
    assert case.num_parameters() > 0
    assert name in repr(case)


def test_sizes_grow() -> None:
    counts = [zoo.get("gpt", size, device="meta").num_parameters() for size in zoo.SIZES]
    assert counts == sorted(counts)
    assert 120e6 < counts[-1] < 130e6  # GPT-2 small with a tied head: 124M


def test_gpt_head_is_tied_to_token_embedding() -> None:
    model = zoo.get("gpt").model
    assert model.lm_head.weight is model.tok_emb.weight
    exported = torch.export.export(model, zoo.get("gpt").example_inputs, strict=False)
    # export gives each name of a tied weight its own placeholder but keeps one tensor: whoever
    # splits the graph must map both placeholders to one parameter and sum their gradients.
    names = exported.graph_signature.parameters
    assert "tok_emb.weight" in names and "lm_head.weight" in names
    assert exported.state_dict["tok_emb.weight"] is exported.state_dict["lm_head.weight"]
    module = exported.module()
    assert module.lm_head.weight is module.tok_emb.weight


def test_gpt_sdpa_matches_explicit_attention() -> None:
    explicit, sdpa = zoo.get("gpt"), zoo.get("gpt", sdpa=True)
    expected = explicit.model(*explicit.example_inputs)
    _assert_same_outputs(expected, sdpa.model(*sdpa.example_inputs))
    _assert_same_outputs(expected, torch.fx.symbolic_trace(sdpa.model)(*sdpa.example_inputs))


def test_gpt_is_causal() -> None:
    case = zoo.get("gpt")
    tokens = case.example_inputs[0]
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % case.config.vocab_size
    before, after = case.model(tokens), case.model(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])


def test_gpt_loss_starts_near_uniform() -> None:
    case = zoo.get("gpt")
    inputs, target = case.make_batch(4, 0)
    loss = case.loss_fn(case.model(*inputs), target)
    assert abs(loss.item() - torch.log(torch.tensor(128.0)).item()) < 0.5


# ---------------------------------------------------------------- random DAG modules


def test_random_dag_spec_is_deterministic_and_round_trips_json() -> None:
    for seed in range(20):
        spec = random_dag_spec(random.Random(seed), max_nodes=15)
        assert spec == random_dag_spec(random.Random(seed), max_nodes=15)
        spec.validate()
        assert DagSpec.from_json(spec.to_json()) == spec
        read = {v for node in spec.nodes for v in node.inputs}
        sinks = {v for v in range(1, len(spec.nodes) + 1) if v not in read}
        assert sinks <= set(spec.outputs), "every unread value must be an output (no dead code)"


@pytest.mark.parametrize("seed", range(8))
def test_random_dag_module_exports_and_traces(seed: int) -> None:
    spec = random_dag_spec(random.Random(seed), max_nodes=20)
    torch.manual_seed(seed)
    module = build_dag_module(spec, width=8)
    x = torch.randn(3, 8)
    expected = module(x)
    assert isinstance(expected, tuple) and len(expected) == len(spec.outputs)
    exported = torch.export.export(module, (x,), strict=False)
    _assert_same_outputs(expected, exported.module()(x))
    _assert_same_outputs(expected, torch.fx.symbolic_trace(module)(x))


def test_dag_with_branches_skips_and_merges() -> None:
    spec = DagSpec(
        nodes=(
            DagNode("linear", (0,)),  # 1
            DagNode("relu", (1,)),  # 2: branch a
            DagNode("layernorm", (1,)),  # 3: branch b
            DagNode("concat_linear", (2, 3)),  # 4: merge
            DagNode("add", (4, 0)),  # 5: skip from the input
            DagNode("mul", (5, 2)),  # 6
        ),
        outputs=(3, 6),
    )
    module = build_dag_module(spec, width=4)
    outputs = torch.fx.symbolic_trace(module)(torch.randn(2, 4))
    assert [tuple(t.shape) for t in outputs] == [(2, 4), (2, 4)]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (DagSpec((DagNode("conv", (0,)),), (1,)), "unknown op 'conv'"),
        (DagSpec((DagNode("add", (0,)),), (1,)), "takes 2 inputs"),
        (DagSpec((DagNode("relu", (1,)),), (1,)), "must lie in \\[0, 0\\]"),
        (DagSpec((DagNode("relu", (0,)),), (2,)), "outputs \\[2\\]"),
        (DagSpec((), (1,)), "no nodes"),
    ],
)
def test_invalid_dag_spec_raises_config_error(spec: DagSpec, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_dag_module(spec, width=4)


# ---------------------------------------------------------------- Hugging Face models


@pytest.fixture
def transformers_offline(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("transformers")


@pytest.mark.hf
@pytest.mark.parametrize("name", zoo.HF_MODELS)
def test_hf_model_trains_and_exports(name: str, transformers_offline: object) -> None:
    case = zoo.hf(name)
    inputs, target = case.make_batch(3, seed=1)
    loss = case.loss_fn(case.model(*inputs), target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    expected = case.model(*case.example_inputs, **case.example_kwargs)
    exported = torch.export.export(
        case.model, case.example_inputs, dict(case.example_kwargs), strict=False
    )
    actual = exported.module()(*case.example_inputs, **case.example_kwargs)
    assert type(actual) is type(expected)  # the Hugging Face ModelOutput survives export
    torch.testing.assert_close(actual.logits, expected.logits)


@pytest.mark.hf
@pytest.mark.parametrize("name", zoo.HF_MODELS)
def test_hf_model_builds_and_exports_on_meta(name: str, transformers_offline: object) -> None:
    with torch.device("meta"):
        case = zoo.hf(name)
    assert all(p.is_meta for p in case.model.parameters())
    assert all(t.is_meta for t in [*case.example_inputs, *case.example_kwargs.values()])
    torch.export.export(case.model, case.example_inputs, dict(case.example_kwargs), strict=False)


@pytest.mark.hf
def test_hf_sdpa_attention_exports(transformers_offline: object) -> None:
    case = zoo.hf("llama", attn_implementation="sdpa")
    assert case.model.config._attn_implementation == "sdpa"
    torch.export.export(case.model, case.example_inputs, strict=False)


@pytest.mark.hf
def test_hf_through_registry_and_overrides(transformers_offline: object) -> None:
    case = zoo.get("hf:gpt2", n_layer=1)
    assert case.name == "hf:gpt2" and case.config.n_layer == 1
    assert not case.config.use_cache
    with pytest.raises(ConfigError, match="preset= for hf:llama"):
        zoo.get("hf:llama", "base")


def test_importing_the_zoo_does_not_import_transformers() -> None:
    code = "import sys, fxsplit.models; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.hf
def test_hf_unknown_names_raise_config_error(transformers_offline: object) -> None:
    with pytest.raises(ConfigError, match="unknown Hugging Face model 'opt'.*bert.*llama"):
        zoo.hf("opt")
    with pytest.raises(ConfigError, match="unknown option.*hidden_sise"):
        zoo.hf("bert", hidden_sise=32)
    with pytest.raises(ConfigError, match="unknown llama preset '8b'"):
        zoo.llama_config("8b")
    with pytest.raises(ConfigError, match="preset= applies to llama only"):
        zoo.hf("bert", preset="7b")


@pytest.mark.hf
@pytest.mark.parametrize(("preset", "low", "high"), [("7b", 6.5e9, 7e9), ("70b", 6.8e10, 7e10)])
def test_llama_preset_on_meta_has_the_right_size_without_memory(
    preset: str, low: float, high: float, transformers_offline: object
) -> None:
    config = zoo.llama_config(preset)
    rss_before = _rss_bytes()
    with torch.device("meta"):
        case = zoo.hf("llama", preset=preset)
    assert case.config.hidden_size == config.hidden_size
    assert low < case.num_parameters() < high
    assert all(p.is_meta for p in case.model.parameters())
    assert _rss_bytes() - rss_before < 512 * 2**20, "building on meta must not allocate weights"
