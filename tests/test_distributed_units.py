"""Unit tests of the distributed runtime's pieces that need no process group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.runtime.dist_stage import Layout, Packing, decode, encode
from fxsplit.runtime.dist_state import StageState, parameters_on_meta, retarget_meta_devices


def test_boundary_values_round_trip_through_tensors():
    layouts = [Layout("tensor"), Layout("list", 2), Layout("scalar", pytype="int"), Layout("none"),
               Layout("scalar", pytype="float"), Layout("scalar", pytype="bool")]
    a, b, c = torch.randn(2, 3).t(), torch.randn(2), torch.randn(1)
    wire = encode([a, [b, c], 7, None, 0.5, True], layouts, torch.device("cpu"))
    assert len(wire) == 6 and all(t.is_contiguous() for t in wire)
    back = decode(wire, layouts)
    torch.testing.assert_close(back[0], a)
    assert [t.shape for t in back[1]] == [b.shape, c.shape]
    assert back[2:] == [7, None, 0.5, True]


def test_meta_capture_factories_are_retargeted():
    # Regression: capturing on the meta device bakes aten.arange(..., device=meta) into the graph
    # (GPT position ids); on CPU the embedding then read garbage and the loss was NaN.
    class Pos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.emb(torch.arange(x.shape[1], device=x.device))

    with torch.device("meta"):
        model = Pos()
    gm = torch.export.export(model, (torch.empty(2, 8, 4, device="meta"),), strict=False).module()
    assert retarget_meta_devices(gm, torch.device("cpu")) >= 1
    assert "meta" not in gm.code


def test_parameters_on_meta_keeps_buffers_real():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("mask", torch.tril(torch.ones(3, 3)), persistent=False)

    with parameters_on_meta():
        m = M()
    assert m.lin.weight.device.type == "meta" and isinstance(m.lin.weight, nn.Parameter)
    assert m.mask.device.type == "cpu" and m.mask.sum() == 6


def test_stage_state_lists_every_alias_of_a_tied_tensor():
    state = StageState(["head.weight", "b"], {"head.weight": ("emb.weight", "head.weight")})
    assert state.keys() == ["emb.weight", "head.weight", "b"]


def test_consolidate_merges_shards_in_original_order(tmp_path):
    import json

    from fxsplit.checkpoint import consolidate

    w = torch.randn(3)
    torch.save({"emb.weight": w, "a": torch.ones(1)}, tmp_path / "stage000.pt")
    torch.save({"emb.weight": w, "head.weight": w}, tmp_path / "stage001.pt")
    index = {"state_order": ["emb.weight", "a", "head.weight"],
             "shards": {"stage000.pt": ["emb.weight", "a"], "stage001.pt": ["emb.weight", "head.weight"]}}
    (tmp_path / "plan.json").write_text(json.dumps(index))
    sd = consolidate(tmp_path)
    assert list(sd) == ["emb.weight", "a", "head.weight"]


def _write_checkpoint(folder, value, shard="stage000.pt", complete=True):
    import json

    folder.mkdir(parents=True)
    torch.save({"w": value}, folder / "stage000.pt")
    (folder / "plan.json").write_text(json.dumps({"state_order": ["w"], "shards": {shard: ["w"]}}))
    if complete:
        (folder / "COMPLETE").write_text("ok\n")


def test_loading_takes_the_last_complete_checkpoint_and_says_which(tmp_path, caplog):
    """Issue 10: loading takes LATEST's folder when it is complete, else the newest complete
    one (a save cut short), and says which; nothing complete is a ConfigError."""
    from fxsplit.checkpoint import consolidate, next_version, resolve
    from fxsplit.errors import ConfigError

    assert next_version(tmp_path) == "ckpt-000001"
    _write_checkpoint(tmp_path / "ckpt-000001", torch.ones(2))
    _write_checkpoint(tmp_path / "ckpt-000002", torch.full((2,), 2.0))
    _write_checkpoint(tmp_path / "ckpt-000003", torch.full((2,), 3.0), complete=False)
    assert next_version(tmp_path) == "ckpt-000004"
    (tmp_path / "LATEST").write_text("ckpt-000001\n")
    assert resolve(tmp_path)[0].endswith("ckpt-000001") and torch.equal(consolidate(tmp_path)["w"], torch.ones(2))
    (tmp_path / "LATEST").write_text("ckpt-000003\n")  # a save that never completed
    folder, which = resolve(tmp_path)
    assert folder.endswith("ckpt-000002") and "newest complete" in which and "not complete" in caplog.text
    assert torch.equal(consolidate(tmp_path)["w"], torch.full((2,), 2.0))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve(tmp_path / "ckpt-000003")


def test_a_shard_name_that_leaves_the_checkpoint_is_refused(tmp_path):
    """Issue 10: a shard named ``../outside/x.pt`` in plan.json was loaded from outside."""
    from fxsplit.checkpoint import consolidate
    from fxsplit.distributed import ShardedStateDict
    from fxsplit.errors import ConfigError

    _write_checkpoint(tmp_path / "ckpt-000001", torch.ones(2), shard="../outside/x.pt")
    (tmp_path / "LATEST").write_text("ckpt-000001\n")
    with pytest.raises(ConfigError, match=r"names shard '\.\./outside/x\.pt'"):
        consolidate(tmp_path)
    with pytest.raises(ConfigError, match=r"names shard '\.\./outside/x\.pt'"):
        ShardedStateDict(tmp_path)


def test_a_damaged_shard_is_a_config_error_naming_it(tmp_path):
    from fxsplit.checkpoint import consolidate
    from fxsplit.errors import ConfigError

    _write_checkpoint(tmp_path / "ckpt-000001", torch.ones(2))
    data = (tmp_path / "ckpt-000001" / "stage000.pt").read_bytes()
    (tmp_path / "ckpt-000001" / "stage000.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"stage000\.pt cannot be read.*damaged"):
        consolidate(tmp_path)


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    from fxsplit.checkpoint import write_atomic

    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def fails(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(str(path), fails)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    write_atomic(str(path), lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new"


def test_watchdog_ends_a_stuck_process():
    import subprocess
    import sys

    from fxsplit.runtime.dist_faults import WATCHDOG_EXIT_CODE

    code = (
        "import time; from fxsplit.runtime.dist_faults import Progress, Watchdog\n"
        "p = Progress(0, 0, 'cpu', action='receiving activations for', microbatch=2)\n"
        "p.started_s = time.monotonic(); Watchdog(p, timeout_s=0.2, grace_s=0.2, poll_s=0.05)\n"
        "time.sleep(30)\n"
    )
    start = __import__("time").monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == WATCHDOG_EXIT_CODE
    assert "stuck" in proc.stderr and "micro-batch 2" in proc.stderr
    assert __import__("time").monotonic() - start < 25


class _Custom(torch.nn.Module):
    """Tensors no ``reset_parameters`` covers: a constant parameter, one initialised after it is
    registered, a float and an integer buffer (non-persistent, so no state dict has them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.full((8,), 0.5))
        self.proj = nn.Parameter(torch.empty(8, 8))
        nn.init.normal_(self.proj, std=3.0)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)), persistent=False)
        self.register_buffer("pos", torch.arange(8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x)) * self.scale @ self.proj
        return (h @ self.mask)[:, self.pos]


def _one_stage(model_fn, inputs):
    """The whole captured model as one stage, on the meta device: (meta model, graph, state)."""
    from fxsplit.passes.capture import capture

    with torch.device("meta"):
        meta = model_fn()
    cap = capture(meta, tuple(x.to("meta") for x in inputs))
    names = list(dict.fromkeys(str(n.target) for n in cap.gm.graph.find_nodes(op="get_attr")))
    return meta, cap.gm, StageState(names, cap.aliases)


def test_without_a_state_dict_each_tensor_gets_the_constructors_kind_of_value():
    # Regression (issue 9): without a state dict, compile failed ("no value for 38 tensor(s)")
    # on any parameter whose module has no reset_parameters (GPT-2's Conv1D). Root cause: the only
    # default was reset_parameters; now the model's own init runs on the stage's modules, and what
    # is left takes the value a second model_fn() call (parameters on meta) gives it.
    from fxsplit.runtime.dist_state import materialise

    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    origin = materialise(gm, state, torch.device("cpu"), state_dict=None, init_fn=None, meta_model=meta, model_fn=_Custom)
    t = {name: tensor.detach() for _g, name, tensor in state.items(gm)}
    assert origin["lin.weight"] == "reset_parameters" and t["lin.weight"].abs().max() <= 8**-0.5
    assert origin["norm.weight"] == "reset_parameters" and bool((t["norm.weight"] == 1).all())
    assert origin["scale"] == "model_fn" and bool((t["scale"] == 0.5).all())
    assert origin["proj"] == "model_fn" and 2.0 < float(t["proj"].std()) < 4.0
    assert origin["mask"] == "model_fn" and torch.equal(t["mask"], torch.tril(torch.ones(8, 8)))
    assert origin["pos"] == "model_fn" and torch.equal(t["pos"], torch.arange(8))
    assert {p.device.type for p in meta.parameters()} == {"meta"}, "the meta model is left as it was"


def test_a_mis_shaped_state_dict_value_is_refused_before_any_write():
    """Issue 10: ``fxsplit.distributed.compile(state_dict=...)`` broadcast a mis-shaped value into
    the stage's tensor; it is now refused, naming key and both shapes."""
    from fxsplit.errors import ConfigError
    from fxsplit.runtime.dist_state import materialise

    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    sd = _Custom().state_dict()
    sd["lin.weight"] = torch.zeros(8)
    with pytest.raises(ConfigError, match=r"lin\.weight: shape \[8\] in the state dict, \[8, 8\] in the model"):
        materialise(gm, state, torch.device("cpu"), state_dict=sd, init_fn=None, meta_model=meta, model_fn=_Custom)


def test_a_tensor_nothing_can_initialise_is_a_config_error_naming_it():
    from fxsplit.errors import ConfigError
    from fxsplit.runtime.dist_state import materialise

    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    with pytest.raises(ConfigError, match=r"'scale'.*state_dict=.*init_fn="):
        materialise(gm, state, torch.device("cpu"), state_dict=None, init_fn=None, meta_model=meta, model_fn=None)


def test_wire_shapes_match_what_the_stages_send_at_any_micro_batch_size():
    """The metadata PipelineStage is given (instead of inferring it by running stages on
    placeholders) equals, tensor for tensor, what stage 0 really sends; the batch size crossing
    as a 0-d int64 tensor carries the micro-batch's size."""
    import dist_workers as w

    from fxsplit.api import CompileOptions
    from fxsplit.codegen import split_graph
    from fxsplit.frontend import front_end
    from fxsplit.ir import DeviceSpec
    from fxsplit.runtime.dist_shapes import WireShapes
    from fxsplit.runtime.dist_stage import StageModule

    model, (x,), _ = w._toy("size_relay", 8)
    spec = DeviceSpec("cpu", peak_flops=50e9, memory_bandwidth_bytes_per_s=20e9, memory_bytes=2**34, torch_device="cpu")
    ins = front_end(model, (x,), {}, reference=spec, cost_model="analytic", options=CompileOptions())
    captured, condensed, flat = ins.captured, ins.condensed, list(ins.flat_inputs)
    half = condensed.num_blocks // 2
    program = split_graph(captured.gm, {b: int(b >= half) for b in range(condensed.num_blocks)}, ["cpu", "cpu"])
    first, second = (StageModule(st.gm, first=i == 0, last=i == 1, batched=[True]) for i, st in enumerate(program.stages))
    assert "scalar" in [layout.kind for layout in second.in_layouts], "the split must send the batch size"
    for size in (3, 5):
        shapes = [WireShapes(captured.gm, flat, [True], inputs=st.inputs, outputs=st.outputs, in_layouts=mod.in_layouts,
                             out_layouts=mod.out_layouts, first=st.index == 0, last=st.index == 1, index=st.index)
                  for st, mod in zip(program.stages, (first, second), strict=True)]
        sent = first(x[:size])  # stage 0's real wire at this micro-batch size
        ins, outs = shapes[1].example_args(size, train=True)
        described = [(t.shape, t.dtype, t.stride(), t.requires_grad) for t in sent]
        assert described == [(t.shape, t.dtype, t.stride(), t.requires_grad) for t in shapes[0].example_args(size, True)[1]]
        assert described == [(t.shape, t.dtype, t.stride(), t.requires_grad) for t in ins]
        assert size in [int(t) for t in sent if t.dim() == 0 and t.dtype == torch.int64]
        assert outs[0].shape == (size, 4, 16)
        assert not any(t.requires_grad for t in shapes[1].example_args(size, train=False)[0])


def test_rank0_profiles_a_meta_capture_of_a_hugging_face_bert():
    """Regression (issue 9): rank 0's profiling of the meta capture of a Hugging Face BERT failed
    with "Cannot copy out of meta tensor": ``attention_mask.to(meta)`` (a *positional* device
    argument of ``aten.to.device``) was left on meta by the materialisation, which only rewrote
    ``device=`` keywords. Every node now runs, and every block gets a positive profiled time."""
    import torch.utils._pytree as pytree

    import fxsplit.models as zoo
    from fxsplit.api import CompileOptions
    from fxsplit.dist_plan import example_batch, profiled_blocks, reference_spec
    from fxsplit.frontend import front_end

    config = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 128,
              "vocab_size": 128, "seq_len": 16}
    case = zoo.get("hf:bert", size="tiny", batch_size=4, **config)
    with torch.device("meta"):
        meta_model = zoo.get("hf:bert", size="tiny", batch_size=4, **config).model
    args = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tuple(case.example_inputs))
    kwargs = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, case.example_kwargs or {})
    options = CompileOptions(profile_cache_dir=False)
    ins = front_end(meta_model, args, kwargs, reference=reference_spec(torch.device("cpu")), cost_model="analytic",
                    options=options)
    captured, condensed = ins.captured, ins.condensed
    assert "device(type='meta')" in captured.gm.code, "the capture has no meta device argument; proves nothing"
    flat, flags, _ = example_batch(captured, (tuple(case.example_inputs), case.example_kwargs or {}))
    graph = profiled_blocks(captured.gm, condensed.graph, flat, flags, torch.device("cpu"), 2, options)
    assert len(graph.blocks) == len(condensed.graph.blocks)
    assert sum(b.fwd_s for b in graph.blocks) > 0 and sum(b.bwd_s for b in graph.blocks) > 0


@pytest.mark.parametrize(("replicas", "tp", "world", "schedule", "strategy", "match"), [
    (3, 1, 4, "1f1b", "auto", "divisor of 4"), (0, 1, 4, "1f1b", "auto", "divisor"),
    (2, 5, 12, "1f1b", "auto", "divides 12"),
    (1, 0, 4, "1f1b", "auto", "tensor_parallel=0"),
    (1, 2, 4, "1f1b", "pase", "tp_strategy='pase'")])
def test_replicas_and_tp_degrees_that_do_not_fit_the_launch_are_refused_before_any_collective(
        replicas, tp, world, schedule, strategy, match) -> None:
    from fxsplit.distributed import _check_replicas

    with pytest.raises(ConfigError, match=match):
        _check_replicas(replicas, world, schedule, tp, strategy)
    if world == 12:
        _check_replicas(2, 12, schedule, 2, strategy)  # 3 stages x 2 replicas x 2 shards fit
        _check_replicas(2, 12, "interleaved-1f1b", 2, strategy)  # looped stages replicate and split too


def test_one_replicas_share_of_the_example_batch() -> None:
    from fxsplit.distributed import _replica_example

    x, lengths = torch.arange(24.0).reshape(8, 3), torch.tensor([3, 1])
    args, kwargs = _replica_example((x,), {"lengths": lengths, "scale": 2.0}, 4)
    assert torch.equal(args[0], x[:2]) and torch.equal(kwargs["lengths"], lengths) and kwargs["scale"] == 2.0
    with pytest.raises(ConfigError, match="multiple of 3"):
        _replica_example((x,), {}, 3)


@pytest.mark.parametrize(("load", "cached"), [(0.0, True), (64.0, False)])
def test_rank0s_profile_is_cached_only_when_the_machine_was_quiet(load, cached, tmp_path, monkeypatch):
    """rank 0's profile (fxsplit.distributed) is kept like fxsplit.compile's: not when other work
    shared the CPUs (load over 1 per core), or every later compile would plan on slow timings."""
    import os

    import fxsplit.models as zoo
    from fxsplit.api import CompileOptions
    from fxsplit.dist_build import to_meta
    from fxsplit.dist_plan import example_batch, profiled_blocks, reference_spec
    from fxsplit.frontend import front_end

    case = zoo.get("mlp", size="tiny", batch_size=4)
    with torch.device("meta"):
        meta_model = zoo.get("mlp", size="tiny", batch_size=4).model
    options = CompileOptions(profile_cache_dir=tmp_path)
    ins = front_end(meta_model, to_meta(tuple(case.example_inputs)), {}, reference=reference_spec(torch.device("cpu")),
                    cost_model="analytic", options=CompileOptions())
    flat, flags, _ = example_batch(ins.captured, (tuple(case.example_inputs), {}))
    monkeypatch.setattr(os, "getloadavg", lambda: (load * (os.cpu_count() or 1), 0.0, 0.0))
    graph = profiled_blocks(ins.captured.gm, ins.condensed.graph, flat, flags, torch.device("cpu"), 2, options)
    assert sum(b.fwd_s for b in graph.blocks) > 0
    assert bool(list(tmp_path.glob("*.json"))) is cached


_WIRE = st.lists(st.tuples(st.lists(st.integers(0, 4), max_size=3), st.sampled_from(["float32", "int64", "bool", "float64"]),
                           st.booleans()), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(_WIRE)
def test_packing_round_trips_values_and_gradients(spec) -> None:
    """Property: unpack(pack(wire)) is the wire (values, shapes, dtypes), one message per
    (dtype, needs a gradient), in order of first appearance; and the gradients that come back
    through the packed buffer are each tensor's own."""
    gen = torch.Generator().manual_seed(len(spec))
    wire = []
    for shape, dtype, grad in spec:
        dt = getattr(torch, dtype)
        t = (torch.randn(shape, generator=gen, dtype=dt) if dt.is_floating_point
             else torch.randint(0, 2 if dt == torch.bool else 9, shape, generator=gen).to(dt))
        wire.append(t.requires_grad_(grad and dt.is_floating_point))
    packing = Packing.of([t.to("meta") for t in wire])
    keys = list(dict.fromkeys((t.dtype, t.requires_grad) for t in wire))
    assert [(wire[g[0]].dtype, wire[g[0]].requires_grad) for g in packing.groups] == keys
    assert sorted(i for g in packing.groups for i in g) == list(range(len(wire)))
    messages = packing.pack(wire)
    metas = packing.metas([t.to("meta") for t in wire])
    assert [(m.shape, m.dtype, m.requires_grad) for m in messages] == [(m.shape, m.dtype, m.requires_grad) for m in metas]
    received = [m.detach().requires_grad_(m.requires_grad) for m in messages]
    back = packing.unpack(received)
    for a, b in zip(wire, back, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach(), b.detach())
    weights = [torch.randn(t.shape, generator=gen, dtype=t.dtype) if t.requires_grad else None for t in wire]
    terms = [(b * w).sum() for b, w in zip(back, weights, strict=True) if w is not None]
    if not terms:
        return
    torch.stack([x.double() for x in terms]).sum().backward()
    torch.autograd.backward([m for m in messages if m.requires_grad],
                            [r.grad for r, m in zip(received, messages, strict=True) if m.requires_grad])
    for t, w in zip(wire, weights, strict=True):
        if w is not None:
            torch.testing.assert_close(t.grad, w)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 40), count=st.integers(1, 9))
def test_chunk_bounds_cut_as_torch_chunk_and_dtensor_shard_do(size: int, count: int) -> None:
    """Each rank's chunk of a split weight, read from the state dict, is the piece DTensor's
    ``Shard`` gives that rank (``torch.chunk``, the missing last chunks empty)."""
    from fxsplit.runtime.dist_state import chunk_bounds

    x = torch.arange(size)
    pieces = list(torch.chunk(x, count)) if size else []
    pieces += [x[:0]] * (count - len(pieces))
    for i, piece in enumerate(pieces):
        start, length = chunk_bounds(size, i, count)
        assert torch.equal(x.narrow(0, start, length), piece), (size, count, i)


def test_a_stage_given_a_state_dict_holds_only_its_chunk_of_each_split_tensor() -> None:
    """Issue 11 (shard at materialisation): ``materialise(shards=...)`` allocates a split tensor
    at its chunk's shape and reads that chunk of the state dict, so the whole never exists on
    the rank; the others load whole; the whole's shape is what the state dict is checked against."""
    from fxsplit.runtime.dist_state import materialise

    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    sd = _Custom().state_dict()
    sd["lin.weight"] = torch.arange(64.0).view(8, 8)
    shards = {"lin.weight": (1, 1, 3), "lin.bias": (0, 0, 3)}
    origin = materialise(gm, state, torch.device("cpu"), state_dict=sd, init_fn=None, meta_model=meta,
                         model_fn=_Custom, shards=shards)
    t = {name: tensor.detach() for _g, name, tensor in state.items(gm)}
    assert origin["lin.weight"] == origin["lin.bias"] == "state_dict"
    assert torch.equal(t["lin.weight"], sd["lin.weight"][:, 3:6])  # chunk 1 of 3 on dim 1: columns 3..5
    assert torch.equal(t["lin.bias"], sd["lin.bias"][:3])
    assert isinstance(gm.get_submodule("lin").weight, nn.Parameter) and gm.get_submodule("lin").weight.requires_grad
    assert t["norm.weight"].shape == (8,) and t["proj"].shape == (8, 8)
    wrong = dict(sd, **{"lin.bias": torch.zeros(3)})
    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    with pytest.raises(ConfigError, match=r"lin\.bias: shape \[3\] in the state dict, \[8\] in the model"):
        materialise(gm, state, torch.device("cpu"), state_dict=wrong, init_fn=None, meta_model=meta,
                    model_fn=_Custom, shards=shards)


@pytest.mark.parametrize("source", ["default", "init_fn"])
def test_chunks_initialised_alike_on_every_rank_make_the_whole_one_rank_would(source: str) -> None:
    """Without a state dict a split tensor is initialised whole one module at a time (its own
    init, or ``init_fn``) and cut: with the same random state, the chunks two ranks hold put
    together are the tensor one rank initialising it whole holds (``reset_parameters`` of the
    Linear, a constructor value from ``model_fn``, an ``init_fn``), and the rest are whole."""
    from fxsplit.runtime.dist_state import materialise

    def init_fn(name: str, tensor: torch.Tensor) -> None:
        tensor.normal_() if tensor.is_floating_point() else tensor.zero_()

    def run(count: int, index: int) -> dict[str, torch.Tensor]:
        meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
        shards = {"lin.weight": (0, index, count), "lin.bias": (0, index, count), "proj": (1, index, count)}
        torch.manual_seed(7)
        origin = materialise(gm, state, torch.device("cpu"), state_dict=None, meta_model=meta, model_fn=_Custom,
                             init_fn=init_fn if source == "init_fn" else None, shards=shards)
        assert source == "init_fn" or (origin["lin.weight"] == "reset_parameters" and origin["proj"] == "model_fn")
        return {name: tensor.detach().clone() for _g, name, tensor in state.items(gm)}

    whole, parts = run(1, 0), [run(2, 0), run(2, 1)]
    assert parts[0]["lin.weight"].shape == (4, 8) and parts[1]["proj"].shape == (8, 4)
    for name, dim in (("lin.weight", 0), ("lin.bias", 0), ("proj", 1)):
        assert torch.equal(torch.cat([p[name] for p in parts], dim=dim), whole[name]), name
    assert torch.equal(parts[0]["norm.weight"], whole["norm.weight"]) and parts[0]["mask"].shape == (8, 8)


def test_a_stage_given_its_chunk_takes_it_as_it_is() -> None:
    """``materialise(chunks_given=...)``: a state-dict value that is this rank's chunk already
    (calibrate's exchange of a tensor-parallel stage) is taken as it is, checked against the
    chunk's shape; without ``chunks_given`` the same value is refused (a user's state dict
    holds whole tensors)."""
    from fxsplit.runtime.dist_state import materialise

    sd = _Custom().state_dict()
    shards = {"lin.weight": (1, 1, 3)}
    piece = torch.arange(24.0).view(8, 3)
    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    materialise(gm, state, torch.device("cpu"), state_dict=dict(sd, **{"lin.weight": piece}), init_fn=None,
                meta_model=meta, model_fn=_Custom, shards=shards, chunks_given={"lin.weight"})
    assert torch.equal(gm.get_submodule("lin").weight.detach(), piece)
    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    with pytest.raises(ConfigError, match=r"lin\.weight: shape \[8, 3\] in the state dict, \[8, 8\] in the model"):
        materialise(gm, state, torch.device("cpu"), state_dict=dict(sd, **{"lin.weight": piece}), init_fn=None,
                    meta_model=meta, model_fn=_Custom, shards=shards)
    meta, gm, state = _one_stage(_Custom, (torch.randn(2, 8),))
    with pytest.raises(ConfigError, match=r"lin\.weight: shape \[8, 2\] in the state dict, \[8, 3\] in the model"):
        materialise(gm, state, torch.device("cpu"), state_dict=dict(sd, **{"lin.weight": piece[:, :2]}),
                    init_fn=None, meta_model=meta, model_fn=_Custom, shards=shards, chunks_given={"lin.weight"})


@st.composite
def _holdings(draw: st.DrawFn) -> tuple[list[dict], list[dict], int]:
    """Random old holdings and new needs of a few tensors over a ``[pp, dp, tp]``-like world."""
    from fxsplit.dist_calibrate import Held

    tp = draw(st.sampled_from([1, 2, 3]))
    pipelines = draw(st.integers(1, 2)) * tp
    world = pipelines * draw(st.integers(1, 3))
    old: list[dict] = [{} for _ in range(world)]
    new: list[dict] = [{} for _ in range(world)]
    for name in ("a", "b", "c"):
        split = tp > 1 and draw(st.booleans())
        for r in range(world):
            t = r % tp
            if draw(st.booleans()):
                chunked = split and draw(st.booleans())
                old[r][name] = Held((6, 2 if chunked else 6), (1, t, tp) if chunked else None)
            if draw(st.booleans()):
                new[r][name] = (1, t, tp) if split and draw(st.booleans()) else None
    return old, new, pipelines


@settings(max_examples=300, deadline=None)
@given(_holdings())
def test_transfer_plan_gives_every_rank_what_its_new_stages_hold(case) -> None:
    """Issue 11 (calibrate on a mesh): :func:`transfer_plan` gives each rank each tensor its new
    stages hold, once, from ranks that hold those pieces: one piece that covers the need (the
    whole, or the very chunk), kept where the rank holds it, else from its own pipeline where one
    there holds it; else every chunk in order; and raises a PlanError exactly where no rank
    holds the tensor, or its chunks are incomplete and nobody holds what is needed."""
    from fxsplit.dist_calibrate import transfer_plan
    from fxsplit.errors import PlanError

    old, new, pipelines = case
    world = len(old)

    def pipeline_of(r: int) -> int:
        return r % pipelines

    impossible = False
    for name in {g for n in new for g in n}:
        holders = [r for r in range(world) if name in old[r]]
        for r in range(world):
            if name not in new[r]:
                continue
            if not any(old[h][name].covers(new[r][name]) for h in holders):
                chunks = {old[h][name].chunk for h in holders}
                count = next((c[2] for c in chunks if c is not None), 0)
                impossible |= not holders or len(chunks) < count or count == 0
    if impossible:
        with pytest.raises(PlanError, match="stage state"):
            transfer_plan(old, new, pipeline_of)
        return
    plan = transfer_plan(old, new, pipeline_of)
    assert sorted((g, r) for g, r, _ in plan) == sorted((g, r) for r in range(world) for g in new[r])
    for name, rank, pieces in plan:
        need = new[rank][name]
        for source, piece in pieces:
            assert old[source][name] == piece
        if len(pieces) == 1:
            source, piece = pieces[0]
            assert piece.covers(need)
            if name in old[rank] and old[rank][name].covers(need):
                assert source == rank
            elif any(pipeline_of(h) == pipeline_of(rank) and old[h][name].covers(need) for h in range(world)
                     if name in old[h]):
                assert pipeline_of(source) == pipeline_of(rank)
        else:
            assert need is None and not any(name in old[h] and old[h][name].covers(need) for h in range(world))
            assert [p.chunk[1] for _, p in pieces] == list(range(len(pieces))) == list(range(pieces[0][1].chunk[2]))
