"""Worker functions of the distributed tests; each runs on one rank (see dist_utils.launch).

Every rank builds the unsplit model itself (the zoo is seeded, so all ranks and the reference
agree), computes the reference loss and gradients in its own process, and checks its own
stage's parameters by original name.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import fxsplit.distributed as fxd
import fxsplit.models as zoo
from fxsplit.api import CompileOptions
from fxsplit.ir import LinkSpec


def _case(name: str, batch: int) -> Any:
    return zoo.get(name, batch_size=batch)


def _model_fn(name: str, batch: int) -> Any:
    return lambda: _case(name, batch).model


def reference(case: Any, inputs: Any, target: Any) -> tuple[float, dict[str, torch.Tensor]]:
    return reference_of(case.model, inputs, target, case.loss_fn)


def reference_of(model: Any, inputs: Any, target: Any, loss_fn: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model's loss and every parameter's gradient (by every name, tied ones too)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(*inputs), target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return float(loss.detach()), grads


def compare(pipe: Any, loss: Any, ref_loss: float, ref_grads: dict[str, torch.Tensor], tag: str) -> dict[str, Any]:
    """Check this rank's loss (last rank) and every gradient of its stage against the reference."""
    checked = []
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{tag}: {name} has no gradient on stage(s) {pipe.stage_indices}"
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # a split stage's shard: gathered
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{tag}: gradient of {n}: {m}")
        checked.append(name)
    if loss is not None:
        torch.testing.assert_close(float(loss), ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tag}: loss {m}")
    return {"checked": checked, "loss": None if loss is None else float(loss)}


def train_equal(rank: int, world: int, out_dir: str, runs: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """For each ``(model, schedule, microbatches, batch)``: one train step equals the unsplit model's."""
    out: dict[str, Any] = {}
    for name, schedule, m, batch in runs:
        tag = f"{name}/{schedule}/m={m}/ranks={world}"
        case = _case(name, batch)
        inputs, target = case.make_batch(batch, 11)
        ref_loss, ref_grads = reference(case, inputs, target)
        # The analytic cost model and a fixed link keep the plan (tied embedding and LM head on
        # different ranks) independent of timing noise; the other workers use the measured defaults.
        pipe = fxd.compile(_model_fn(name, batch), case.example_inputs, schedule=schedule, microbatches=m,
                           state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                           options=CompileOptions(link=LinkSpec()))
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
        out[tag] = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag)
        out[tag]["broadcast"] = float(loss)
        out[tag]["tied"] = [t.name for t in pipe.tied]
        out[tag]["stage_times_s"] = pipe.stage_times_s()
        out[tag]["trace"] = [(e.stage, e.kind, e.microbatch, e.start_s, e.end_s) for e in pipe.gather_trace()]
        pipe.trace(os.path.join(out_dir, f"trace-{schedule}-{m}-{batch}.json"))
        pipe.close()
    return out


def interleaved_equal(rank: int, world: int, out_dir: str, batches: list[int],
                      schedule: str = "interleaved-1f1b") -> dict[str, Any]:
    """``schedule`` (interleaved ones: two stages per rank, stage s on rank s mod world) on the
    tied GPT: for each batch size, a train step and a forward equal the unsplit model's; then the
    stage times cover every stage and a save merges into the model's state dict."""
    from fxsplit.checkpoint import consolidate, resolve
    from fxsplit.ir.problem import LOOPED_SCHEDULES

    out: dict[str, Any] = {}
    for batch in batches:
        case = _case("gpt", batch)
        inputs, target = case.make_batch(batch, 11)
        ref_loss, ref_grads = reference(case, inputs, target)
        v = 2 if schedule in LOOPED_SCHEDULES else 1
        pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule=schedule,
                           microbatches=4, state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                           options=CompileOptions(link=LinkSpec(), stages_per_device=v))
        tag = f"gpt/{schedule}/batch={batch}"
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
        out[tag] = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag)
        out[tag].update(stages=list(pipe.stage_indices), num_stages=pipe.num_stages, tied=[t.name for t in pipe.tied],
                        stage_times_s=pipe.stage_times_s(), broadcast=float(loss))
        with torch.no_grad():
            output = pipe(*inputs)
            if pipe.is_last:
                torch.testing.assert_close(output, case.model(*inputs), rtol=1e-5, atol=1e-6)
        ckpt = os.path.join(out_dir, f"ckpt-{batch}")
        pipe.save(ckpt)
        if rank == 0:
            merged = consolidate(ckpt)
            expected = case.model.state_dict()
            assert list(merged) == list(expected), "the checkpoint's keys are not the model's, in order"
            for key, value in expected.items():
                torch.testing.assert_close(merged[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
            folder, _ = resolve(ckpt)
            out[tag]["shards"] = sorted(f for f in os.listdir(folder) if f.startswith("stage"))
        pipe.close()
    return out


def auto_equal(rank: int, world: int, out_dir: str, batch: int) -> dict[str, Any]:
    """``schedule="auto"``: rank 0 chooses the schedule and micro-batch count, every rank runs
    its choice, and one train step equals the unsplit model's."""
    case = _case("gpt", batch)
    inputs, target = case.make_batch(batch, 11)
    ref_loss, ref_grads = reference(case, inputs, target)
    pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="auto", state_dict=case.model.state_dict(),
                       timeout_s=30, cost_model="analytic", options=CompileOptions(link=LinkSpec()))
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
    out = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, "gpt/auto")
    out.update(schedule=pipe.schedule_kind, microbatches=pipe.microbatches, plan_schedule=pipe.plan.schedule,
               plan_microbatches=pipe.plan.microbatches, stages=list(pipe.stage_indices), num_stages=pipe.num_stages)
    pipe.close()
    return out


def save_then_load(rank: int, world: int, out_dir: str, ckpt: str, phase: str) -> dict[str, Any]:
    """Phase "save": one SGD step, save. Phase "load": load, one more SGD step, compare."""
    batch, name = 6, "gpt"
    case = _case(name, batch)
    opt_ref = torch.optim.SGD(case.model.parameters(), lr=0.1)
    inputs0, target0 = case.make_batch(batch, 1)
    inputs1, target1 = case.make_batch(batch, 2)
    if phase == "save":
        # analytic costs and a fixed link: a plan independent of timing noise (a profiled plan
        # once left stage 0 without parameters, and SGD refuses an empty list)
        pipe = fxd.compile(_model_fn(name, batch), case.example_inputs, schedule="1f1b", microbatches=3,
                           state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                           options=CompileOptions(link=LinkSpec()))
        params = list(pipe.parameters())
        pipe.train_step(*inputs0, target=target0, loss_fn=case.loss_fn)
        if params:
            torch.optim.SGD(params, lr=0.1).step()
        pipe.save(ckpt)
        pipe.close()
        return {"saved": list(pipe.state_dict())}
    # the unsplit model: the same two steps
    for inputs, target in ((inputs0, target0), (inputs1, target1)):
        opt_ref.zero_grad()
        ref_loss_t = case.loss_fn(case.model(*inputs), target)
        ref_loss_t.backward()
        if inputs is inputs1:
            ref_grads = {n: p.grad.clone() for n, p in case.model.named_parameters(remove_duplicate=False)}
            ref_loss = float(ref_loss_t.detach())
        opt_ref.step()
    pipe = fxd.load(ckpt, _model_fn(name, batch), case.example_inputs, microbatches=2, timeout_s=30,
                    cost_model="analytic", options=CompileOptions(link=LinkSpec()))
    params = list(pipe.parameters())
    loss = pipe.train_step(*inputs1, target=target1, loss_fn=case.loss_fn)
    out = compare(pipe, loss, ref_loss, ref_grads, "after load")
    if params:
        torch.optim.SGD(params, lr=0.1).step()
    ref_state = case.model.state_dict()
    for k, v in pipe.state_dict().items():
        torch.testing.assert_close(v, ref_state[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k} after the step: {m}")
    pipe.close()
    return out


def killed_mid_step(rank: int, world: int, out_dir: str, victim: int, timeout_s: float) -> dict[str, Any]:
    """Rank ``victim`` dies (os._exit) in the forward of micro-batch 1 of the second step."""
    batch = 4
    case = _case("unet", batch)
    pipe = fxd.compile(_model_fn("unet", batch), case.example_inputs, schedule="gpipe", microbatches=2,
                       state_dict=case.model.state_dict(), timeout_s=timeout_s)
    inputs, target = case.make_batch(batch, 3)
    pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    if rank == victim:
        calls = {"n": 0}

        def die(module: Any, args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                os._exit(13)

        pipe.module.register_forward_pre_hook(die)
    start = time.monotonic()
    try:
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    finally:
        with open(os.path.join(out_dir, f"elapsed{rank}.txt"), "w") as f:
            f.write(str(time.monotonic() - start))
    return {"finished": True}


def raises_in_loss(rank: int, world: int, out_dir: str, timeout_s: float) -> dict[str, Any]:
    """The last rank's loss_fn raises in the second micro-batch; the others must not hang."""
    batch = 4
    case = _case("unet", batch)
    pipe = fxd.compile(_model_fn("unet", batch), case.example_inputs, schedule="gpipe", microbatches=2,
                       state_dict=case.model.state_dict(), timeout_s=timeout_s)
    inputs, target = case.make_batch(batch, 3)
    pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)  # gradients to keep
    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    calls = {"n": 0}

    def bad_loss(out: Any, tgt: Any) -> Any:
        if out.requires_grad:  # not the reduction check, which runs on detached outputs
            calls["n"] += 1
            if calls["n"] == 2:  # micro-batch 1 (shapes are given up front: torch infers none)
                raise ValueError("loss exploded")
        return case.loss_fn(out, tgt)

    start = time.monotonic()
    try:
        pipe.train_step(*inputs, target=target, loss_fn=bad_loss)
    finally:
        kept = all(torch.equal(p.grad, before[n]) for n, p in pipe.named_parameters())
        with open(os.path.join(out_dir, f"elapsed{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start} {kept}")
    return {"finished": True}


def _expect_error(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "message": str(exc), "elapsed_s": time.monotonic() - start}
    return {"error": None, "message": "", "elapsed_s": time.monotonic() - start}


def bad_launches(rank: int, world: int, out_dir: str, plans: dict[str, str]) -> dict[str, Any]:
    """A 3-stage plan on 2 ranks (must fail fast), rank 1 building a wider model than rank 0 (must
    fail on every rank), a 2-stage plan made for a deeper model (must fail on every rank), and
    rank 1 failing to capture while the ranks profile together (must fail on every rank, in time)."""
    from fxsplit.ir import Plan

    case = _case("gpt", 4)
    out = {"world": _expect_error(lambda: fxd.compile(
        _model_fn("gpt", 4), case.example_inputs, schedule="gpipe", microbatches=2,
        plan=Plan.from_json(plans["three_stages"]), timeout_s=20))}
    width = 32 if rank == 0 else 48
    out["plan"] = _expect_error(lambda: fxd.compile(
        lambda: zoo.get("gpt", batch_size=4, width=width).model, case.example_inputs,
        schedule="gpipe", microbatches=2, timeout_s=20))
    out["deeper"] = _expect_error(lambda: fxd.compile(
        _model_fn("gpt", 4), case.example_inputs, schedule="gpipe", microbatches=2,
        plan=Plan.from_json(plans["deeper"]), timeout_s=20))
    # every rank profiles with rank 0 (profile_all_ranks) but rank 1 cannot even capture: it must
    # still take part in the profiling collectives, and the failure reach both ranks
    out["capture"] = _expect_error(lambda: fxd.compile(
        (lambda: _Unexportable()) if rank == 1 else _model_fn("gpt", 4), case.example_inputs, schedule="gpipe",
        microbatches=2, timeout_s=20, options=CompileOptions(profile_all_ranks=True)))
    return out


class _Unexportable(torch.nn.Module):
    """A model whose forward fails in capture (rank 1 of :func:`bad_launches`)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model cannot be captured")


def tied_copies_start_equal(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Without a state dict every rank initialises its own copy of the tied embedding: after
    compile the copies must hold the same values (the first holder's)."""
    import torch.distributed as dist

    batch = 2 * world
    torch.manual_seed(1000 + rank)  # different random streams on every rank
    case = _case("gpt", batch)
    # analytic costs and a fixed link: the tied embedding and LM head on different ranks whatever
    # the machine's load (a profiled plan once kept both on one rank, with nothing to check)
    pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="1f1b", microbatches=world, timeout_s=30,
                       cost_model="analytic", options=CompileOptions(link=LinkSpec()))
    sums = {n: float(p.detach().double().sum()) for n, p in pipe.named_parameters() if n in ("tok_emb.weight", "lm_head.weight")}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, sums)
    pipe.close()
    return {"sums": gathered}


def forward_equal(rank: int, world: int, out_dir: str, batch: int, m: int) -> dict[str, Any]:
    """Inference on a batch that splits into unequal micro-batches equals the unsplit model."""
    case = _case("gpt", batch)
    inputs, _ = case.make_batch(batch, 5)
    pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="gpipe", microbatches=m,
                       state_dict=case.model.state_dict(), timeout_s=30)
    out = pipe(*inputs)
    if pipe.is_last:
        with torch.no_grad():
            torch.testing.assert_close(out, case.model(*inputs), rtol=1e-4, atol=1e-5)
    pipe.close()
    return {"last": pipe.is_last}


class SizeRelay(torch.nn.Module):
    """Rows through three linears, then back to ``[batch, 4, 16]``: the batch size is read on the
    first stage (``x.shape[0]``) and used by the last one's ``view``, so it crosses as a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = self.b(self.a(x.reshape(n * 4, 16)).relu()).relu()
        return self.c(h).reshape(n, 4, 16)


class FixedMix(torch.nn.Module):
    """``x [batch, 8]`` times a fixed ``mix [8, 8]``: with a batch of 8, ``mix`` has the batch size
    on dim 0 but is the same matrix for every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 256), torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x @ mix).relu())


class SeqFirst(torch.nn.Module):
    """A sequence-first encoder: ``x [seq, batch, 16]`` (``batch_dim=1``), output ``[seq, batch, 16]``."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


def _toy(name: str, batch: int) -> tuple[Any, tuple[torch.Tensor, ...], torch.Tensor]:
    torch.manual_seed(0)
    if name == "seq_first":
        return SeqFirst(), (torch.randn(5, batch, 16),), torch.randn(5, batch, 16)
    if name == "size_relay":
        return SizeRelay(), (torch.randn(batch, 4, 16),), torch.randn(batch, 4, 16)
    return FixedMix(), (torch.randn(batch, 8), torch.randn(8, 8)), torch.randn(batch, 8)


def toy_train_equal(rank: int, world: int, out_dir: str, name: str, runs: list[tuple[str, int]], batch: int,
                    reduction: str = "mean") -> dict[str, Any]:
    """A toy model (see :func:`_toy`): one train step per ``(schedule, microbatches)`` equals the
    unsplit model's (MSE with ``reduction``); reports the layouts this rank receives."""
    model, inputs, target = _toy(name, batch)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target, reduction=reduction)

    ref = loss_fn(model(*inputs), target)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    for schedule, m in runs:
        pipe = fxd.compile(lambda: _toy(name, batch)[0], inputs, schedule=schedule, microbatches=m,
                           state_dict=model.state_dict(), timeout_s=30, batch_dim=1 if name == "seq_first" else 0)
        loss = pipe.train_step(*inputs, target=target, loss_fn=loss_fn)
        tag = f"{name}/{schedule}/m={m}"
        out[tag] = compare(pipe, loss, float(ref.detach()), ref_grads, tag)
        out[tag]["received"] = [layout.kind for layout in pipe.module.in_layouts] if not pipe.is_first else []
        out[tag]["batched"] = list(pipe.module.batched)
        if pipe.is_last:  # forward too: the outputs come back in the model's layout
            torch.testing.assert_close(pipe(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
        else:
            pipe(*inputs)
        pipe.close()
    return out


class BatchCentred(torch.nn.Module):
    """Subtracts the batch mean of its hidden rows: not per-sample (each sample's output depends
    on the others in its micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 64), torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0, keepdim=True))


def not_per_sample_warned(rank: int, world: int, out_dir: str, batch: int) -> dict[str, Any]:
    """Compile :class:`BatchCentred` with two micro-batches; report this rank's
    ``NotPerSampleWarning`` messages and the plan's stats."""
    import warnings

    from fxsplit.errors import NotPerSampleWarning

    torch.manual_seed(0)
    model = BatchCentred()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = fxd.compile(BatchCentred, (torch.randn(batch, 8),), schedule="gpipe", microbatches=2,
                           state_dict=model.state_dict(), timeout_s=30, options=CompileOptions(link=LinkSpec()))
    pipe.close()
    return {"warned": [str(w.message) for w in caught if issubclass(w.category, NotPerSampleWarning)],
            "plan_stats": dict(pipe.plan.stats)}


# -- Hugging Face GPT-2 (tests/test_distributed_hf.py) ------------------------------------------
def gpt2_config(layers: int = 2, width: int = 64, vocab: int = 256, seq: int = 16) -> Any:
    """A small ``GPT2Config``: tied embeddings, no KV cache, no dropout (so losses compare)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq, use_cache=False,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def gpt2_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt2(config: Any) -> Any:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _gpt2_batch(config: Any, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, config.vocab_size, (batch, config.n_positions + 1), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gpt2_train_equal(rank: int, world: int, out_dir: str, runs: list[tuple[str, int]], batch: int) -> dict[str, Any]:
    """With the unsplit model's state dict: loss and every gradient equal the unsplit model's."""
    config = gpt2_config()
    model = _gpt2(config)
    ids, target = _gpt2_batch(config, batch)
    ref = gpt2_loss(model(ids), target)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    ref_grads["lm_head.weight"] = ref_grads["transformer.wte.weight"]  # one tensor, two names
    out: dict[str, Any] = {}
    for schedule, m in runs:
        tag = f"gpt2/{schedule}/m={m}"
        pipe = fxd.compile(lambda: _gpt2(config), (ids,), schedule=schedule, microbatches=m,
                           state_dict=model.state_dict(), timeout_s=60)
        loss = pipe.train_step(ids, target=target, loss_fn=gpt2_loss)
        out[tag] = compare(pipe, loss, float(ref.detach()), ref_grads, tag)
        out[tag]["received"] = [layout.kind for layout in pipe.module.in_layouts] if not pipe.is_first else []
        pipe.close()
    return out


def gpt2_default_init(rank: int, world: int, out_dir: str, schedule: str, m: int, batch: int) -> dict[str, Any]:
    """Without a state dict: per-parameter statistics, the tied copies, and one train step whose
    loss equals the unsplit model's given the same (gathered) weights."""
    import torch.distributed as dist

    config = gpt2_config()
    ids, target = _gpt2_batch(config, batch)
    torch.manual_seed(100 + rank)
    pipe = fxd.compile(lambda: _gpt2(config), (ids,), schedule=schedule, microbatches=m, timeout_s=60)
    stats = {n: (float(p.detach().mean()), float(p.detach().std()) if p.numel() > 1 else 0.0,
                 float(p.detach().min()), float(p.detach().max())) for n, p in pipe.named_parameters()}
    shards: list[Any] = [None] * world
    dist.all_gather_object(shards, {k: v.clone() for k, v in pipe.state_dict().items()})
    loss = pipe.train_step(ids, target=target, loss_fn=gpt2_loss, broadcast_loss=True)
    model = _gpt2(config)
    model.load_state_dict({k: v for shard in shards for k, v in shard.items()})
    with torch.no_grad():
        ref = float(gpt2_loss(model(ids), target))
    pipe.close()
    return {"stats": stats, "shards": shards, "loss": float(loss), "ref": ref}


def gpt2_all(rank: int, world: int, out_dir: str, runs: list[tuple[str, int]], batch: int) -> dict[str, Any]:
    """:func:`gpt2_train_equal` then :func:`gpt2_default_init` (1F1B) in one launch."""
    return {"equal": gpt2_train_equal(rank, world, out_dir, runs, batch),
            "init": gpt2_default_init(rank, world, out_dir, "1f1b", runs[-1][1], batch)}


def planned_on_rank0(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Every rank but 0 is forbidden to measure a device or solve: the plan must come from rank 0."""
    import fxsplit.dist_plan as dp

    if rank != 0:
        def forbidden(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"rank {rank} planned")

        dp.reference_spec = dp._solve = dp.profiled_blocks = forbidden  # type: ignore[assignment]
    batch = 2 * world
    case = _case("gpt", batch)
    pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="gpipe", microbatches=2,
                       state_dict=case.model.state_dict(), timeout_s=30,
                       options=CompileOptions(profile_cache_dir=False, profile_all_ranks=False))
    pipe.close()
    plan = pipe.running_plan()
    # by default every rank profiles with rank 0 (CompileOptions.profile_all_ranks), still only rank 0 plans
    together = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="gpipe", microbatches=2,
                           state_dict=case.model.state_dict(), timeout_s=30,
                           options=CompileOptions(profile_cache_dir=False))
    together.close()
    return {"reference": pipe.meta["reference"], "stages": [list(s.blocks) for s in plan.stages],
            "cost_model": pipe.meta["cost_model"], "plan_stats": dict(plan.stats),
            "profiled_ranks": [pipe.meta["profiled_ranks"], together.meta["profiled_ranks"]],
            "together_stages": [list(s.blocks) for s in together.running_plan().stages]}


def killed_mid_save(rank: int, world: int, out_dir: str, ckpt: str, timeout_s: float) -> dict[str, Any]:
    """Save, train a step, save again; rank 1 dies (os._exit) half-way through writing its
    second shard. Each rank writes what the first checkpoint holds of its stage to out_dir."""
    batch = 4
    case = _case("gpt", batch)
    pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="1f1b", microbatches=2,
                       state_dict=case.model.state_dict(), timeout_s=timeout_s, cost_model="analytic",
                       options=CompileOptions(link=LinkSpec()))
    pipe.save(ckpt)
    torch.save(pipe.state_dict(), os.path.join(out_dir, f"first{rank}.pt"))
    inputs, target = case.make_batch(batch, 3)
    opt = torch.optim.SGD(list(pipe.parameters()), lr=0.5)
    pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    opt.step()
    if rank == 1:
        real_save = torch.save

        def half_then_die(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            import io

            buf = io.BytesIO()
            real_save(obj, buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            os._exit(13)

        torch.save = half_then_die  # type: ignore[assignment]
    pipe.save(ckpt)
    return {"finished": True}


# -- calibrate across processes (tests/test_distributed.py) -------------------------------------
class MatrixExp(torch.nn.Module):
    """A layer the analytic model prices far too low: ``matrix_exp`` costs one FLOP per element
    there, but runs a dozen small matrix products per matrix (see tests/test_calibrate.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        e = torch.linalg.matrix_exp(h.unsqueeze(-1) * h.unsqueeze(-2) * 0.01).sum(-1)
        return torch.cat([h, e, e[:, :16]], -1)


def _calibration_case(name: str, batch: int) -> tuple[Any, Any, tuple, torch.Tensor, Any]:
    """``(model_fn, model, inputs, target, loss_fn)``; every call of ``model_fn`` builds the same model."""
    if name == "matrix_exp":
        def build() -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(MatrixExp(), MatrixExp(), MatrixExp(),
                                       *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(9)])
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, 64, generator=gen), torch.randn(batch, 64, generator=gen)
        return build, build(), (x,), y, torch.nn.functional.mse_loss
    case = _case(name, batch)
    inputs, target = case.make_batch(batch, 11)
    return _model_fn(name, batch), case.model, tuple(inputs), target, case.loss_fn


def calibrate_rebuilds(rank: int, world: int, out_dir: str, name: str, plan_json: str | None, min_gain: float,
                       batch: int, microbatches: int = 2, schedule: str = "gpipe") -> dict[str, Any]:
    """Compile (analytic costs, or the given plan), calibrate, then check that one train step still
    equals the unsplit model's and that the stage holds the model's own values under its keys."""
    from fxsplit.ir import Plan

    model_fn, model, inputs, target, loss_fn = _calibration_case(name, batch)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref_grads = reference_of(model, inputs, target, loss_fn)
    plan = Plan.from_json(plan_json) if plan_json is not None else None
    pipe = fxd.compile(model_fn, inputs, schedule=schedule, microbatches=microbatches, state_dict=original, plan=plan,
                       cost_model="analytic", timeout_s=60, options=CompileOptions(allow_idle_devices=False,
                                                                                    link=LinkSpec()))
    report = pipe.calibrate(*inputs, target=target, loss_fn=loss_fn, steps=3, min_gain=min_gain, rounds=2)
    assert all(p.grad is None for p in pipe.parameters()), "calibrate left gradients behind"
    loss = pipe.train_step(*inputs, target=target, loss_fn=loss_fn)
    out = compare(pipe, loss, ref_loss, ref_grads, f"{name} after calibrate")
    mine = pipe.state_dict()
    for key, value in mine.items():
        torch.testing.assert_close(value, original[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    out.update(keys=sorted(mine), replanned=report.replanned, gains=report.predicted_gains, stages_before=report.stages_before,
               stages_after=report.stages_after, table=report.format_table(), calibrated=pipe.calibrated,
               plan_stats=dict(pipe.plan.stats),
               imbalance_before=_imbalance(report.before), imbalance_after=_imbalance(report.after),
               step_ratio_before=report.step_before_s[1] / report.step_before_s[0],
               step_ratio_after=report.step_after_s[1] / report.step_after_s[0], plan_stages=[list(st.blocks) for st in pipe.plan.stages],
               tied=[t.name for t in pipe.tied])
    pipe.close()
    return out


def calibrate_on_mesh(rank: int, world: int, out_dir: str, name: str, plan_json: str, replicas: int, tp: int,
                      batch: int, microbatches: int) -> dict[str, Any]:
    """Compile a given (lopsided) plan on a ``[pp, dp, tp]`` mesh, calibrate (rebuild on any gain),
    then one train step against the unsplit model; the whole state gathered from every rank
    must be the model's own values under its keys, and each split weight only a chunk here."""
    from fxsplit.ir import Plan

    model_fn, model, inputs, target, loss_fn = _calibration_case(name, batch)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref_grads = reference_of(model, inputs, target, loss_fn)
    pipe = fxd.compile(model_fn, inputs, schedule="1f1b", microbatches=microbatches, state_dict=original,
                       plan=Plan.from_json(plan_json), cost_model="analytic", timeout_s=60, replicas=replicas,
                       tensor_parallel=tp, tp_strategy="megatron",
                       options=CompileOptions(allow_idle_devices=False, link=LinkSpec()))
    before = list(pipe.stage_indices), [list(st.blocks) for st in pipe.plan.stages]
    report = pipe.calibrate(*inputs, target=target, loss_fn=loss_fn, steps=2, min_gain=0.0, rounds=2)
    assert all(p.grad is None for p in pipe.parameters()), "calibrate left gradients behind"
    loss = pipe.train_step(*inputs, target=target, loss_fn=loss_fn, broadcast_loss=True)
    out = compare(pipe, loss, ref_loss, ref_grads, f"{name} dp={replicas} tp={tp} after calibrate")
    every: list[Any] = [None] * world
    torch.distributed.all_gather_object(every, pipe.state_dict())
    for part in every:
        for key, value in part.items():
            torch.testing.assert_close(value, original[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    keys = sorted({k for part in every for k in part})
    local = {n: (tuple(p.to_local().shape), tuple(p.shape)) for n, p in pipe.named_parameters() if isinstance(p, DTensor)}
    out.update(keys=keys, original_keys=sorted(original), replanned=report.replanned, gains=report.predicted_gains,
               before=before, stages=list(pipe.stage_indices), plan_stages=[list(st.blocks) for st in pipe.plan.stages],
               table=report.format_table(), local=local, replica=None if pipe.replicas is None else pipe.replicas.index)
    pipe.close()
    return out


def _imbalance(rows: Any) -> float:
    t = [r.meas_fwd_s + r.meas_bwd_s for r in rows]
    return max(t) / min(t)


def recompute_equal(rank: int, world: int, out_dir: str, schedules: list[str], batch: int) -> dict[str, Any]:
    """Issue 13 item 1: every stage recomputes its activations (``recompute="all"``); the tied
    GPT's loss and every gradient equal the unsplit model's under each schedule."""
    out: dict[str, Any] = {}
    for schedule in schedules:
        tag = f"gpt/{schedule}/recompute"
        case = _case("gpt", batch)
        inputs, target = case.make_batch(batch, 11)
        ref_loss, ref_grads = reference(case, inputs, target)
        pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule=schedule, microbatches=4,
                           state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                           options=CompileOptions(link=LinkSpec(), recompute="all", allow_idle_devices=False))
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
        out[tag] = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag)
        out[tag]["planned"] = [st.recompute for st in pipe.running_plan().stages]
        out[tag]["running"] = [st.module.recomputed is not None for st in pipe.stages]
        pipe.close()
    return out


def autocast_equal(rank: int, world: int, out_dir: str, runs: list[tuple[str, str, int, float]], batch: int) -> dict[str, Any]:
    """Issue 13 item 2: bf16 autocast across processes. For each ``(model, schedule, m, rel)``: the
    loss and every gradient equal the unsplit model's under the same autocast, to ``rel`` of the
    largest magnitude; the dtypes of the tensors rank 0 sends are reported."""
    out: dict[str, Any] = {}
    for name, schedule, m, rel in runs:
        tag = f"{name}/{schedule}/m={m}/bf16"
        case = _case(name, batch)
        inputs, target = case.make_batch(batch, 11)
        model = copy.deepcopy(case.model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = case.loss_fn(model(*inputs), target)
        ref_loss.backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
        pipe = fxd.compile(_model_fn(name, batch), case.example_inputs, schedule=schedule, microbatches=m,
                           state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                           options=CompileOptions(link=LinkSpec(), autocast="bf16", allow_idle_devices=False))
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
        torch.testing.assert_close(float(loss), float(ref_loss), rtol=0, atol=rel * abs(float(ref_loss)))
        checked = []
        for pname, p in pipe.named_parameters():
            scale = float(ref[pname].abs().max()) or 1.0
            torch.testing.assert_close(p.grad, ref[pname], rtol=0, atol=rel * scale,
                                       msg=lambda msg, n=pname, t=tag: f"{t}: gradient of {n}: {msg}")
            checked.append(pname)
        wire = [str(t.dtype) for st in pipe.stages if not st.module.last
                for t in st.shapes.example_args(batch // m, train=True)[1]]
        out[tag] = {"checked": checked, "wire": wire}
        pipe.close()
    return out


def _fp16_reference(case: Any, inputs: Any, target: Any, init_scale: float) -> dict[str, Any]:
    """One SGD step of the unsplit model under fp16 autocast with a plain ``torch.amp.GradScaler``:
    the loss, the scaled and the unscaled gradients (every name, tied ones too), the state after
    the step and the scale after ``update``."""
    model = copy.deepcopy(case.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = case.loss_fn(model(*inputs), target)
    scaler.scale(loss).backward()
    named = list(model.named_parameters(remove_duplicate=False))
    scaled = {n: p.grad.clone() for n, p in named if p.grad is not None}
    scaler.unscale_(opt)
    grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
    scaler.step(opt)
    scaler.update()
    return {"loss": float(loss), "scaled": scaled, "grads": grads, "state": model.state_dict(),
            "scale": scaler.get_scale()}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """``got`` equals ``want`` to ``rel`` of ``want``'s largest magnitude."""
    torch.testing.assert_close(got, want, rtol=0, atol=rel * (float(want.abs().max()) or 1.0),
                               msg=lambda m: f"{what}: {m}")


def _fp16_pipe(name: str, batch: int, schedule: str, m: int, replicas: int = 1) -> Any:
    case = _case(name, batch)
    return fxd.compile(_model_fn(name, batch), case.example_inputs, schedule=schedule, microbatches=m,
                       state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic", replicas=replicas,
                       options=CompileOptions(link=LinkSpec(), autocast="fp16", allow_idle_devices=False))


def fp16_scaling(rank: int, world: int, out_dir: str, runs: list[tuple[str, str, int, float]], batch: int,
                 replicas: int = 1) -> dict[str, Any]:
    """Issue 13 item 2: fp16 autocast with loss scaling across processes.

    For each ``(model, schedule, m, rel)``: one step with ``pipe.grad_scaler()`` equals the
    unsplit model's under the same autocast and a ``torch.amp.GradScaler`` of the same scale (the
    loss unscaled, every gradient scaled after backward and unscaled after ``unscale_``, the
    state after ``scaler.step``, the scale after ``update``), to ``rel`` of the largest magnitude.
    Then ``"overflow"``: an inf put into one gradient on rank 0 only makes every rank skip the
    step and halve its scale; the next step, clean, is taken everywhere; and a plain
    ``torch.amp.GradScaler`` is refused on every rank before any communication. ``replicas``:
    every stage replicated (``compile(replicas=...)``), each replica a share of the batch."""
    out: dict[str, Any] = {}
    for name, schedule, m, rel in runs:
        tag = f"{name}/{schedule}/m={m}/fp16"
        case = _case(name, batch)
        inputs, target = case.make_batch(batch, 11)
        ref = _fp16_reference(case, inputs, target, 2.0**10)
        pipe = _fp16_pipe(name, batch, schedule, m, replicas)
        scaler = pipe.grad_scaler(init_scale=2.0**10)
        opt = torch.optim.SGD(list(pipe.parameters()) or [{"params": []}], lr=0.1)
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True, grad_scaler=scaler)
        torch.testing.assert_close(float(loss), ref["loss"], rtol=0, atol=rel * abs(ref["loss"]))
        checked = []
        for pname, p in pipe.named_parameters():
            _close(p.grad, ref["scaled"][pname], rel, f"{tag}: scaled gradient of {pname}")
            checked.append(pname)
        scaler.unscale_(opt)
        for pname, p in pipe.named_parameters():
            _close(p.grad, ref["grads"][pname], rel, f"{tag}: unscaled gradient of {pname}")
        scaler.step(opt)
        scaler.update()
        for key, value in pipe.state_dict().items():
            _close(value, ref["state"][key], rel, f"{tag}: {key} after the step")
        out[tag] = {"checked": checked, "loss": float(loss), "scale": scaler.get_scale(), "ref_scale": ref["scale"]}
        pipe.close()
    out["overflow"] = _fp16_overflow(rank, batch, replicas)
    return out


def _fp16_overflow(rank: int, batch: int, replicas: int = 1) -> dict[str, Any]:
    """See :func:`fp16_scaling`: the overflow on rank 0 alone, the clean step after it, the
    refusal of a plain GradScaler."""
    from fxsplit.errors import ConfigError

    case = _case("mlp", batch)
    inputs, target = case.make_batch(batch, 12)
    pipe = _fp16_pipe("mlp", batch, "1f1b", 2, replicas)
    scaler = pipe.grad_scaler(init_scale=2.0**10)
    opt = torch.optim.SGD(list(pipe.parameters()), lr=0.1)
    out: dict[str, Any] = {"changed": [], "scale": []}
    for step in range(2):
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, grad_scaler=scaler)
        if step == 0 and rank == 0:
            next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")  # this rank's own overflow
        scaler.step(opt)
        scaler.update()
        out["changed"].append([n for n, p in pipe.named_parameters() if not torch.equal(p.detach(), before[n])])
        out["scale"].append(scaler.get_scale())
    try:
        pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, grad_scaler=torch.amp.GradScaler("cpu"))
        out["refused"] = None
    except ConfigError as exc:
        out["refused"] = str(exc)
    out["params"] = len(list(pipe.parameters()))
    pipe.close()
    return out


def replicas_equal(rank: int, world: int, out_dir: str, runs: list[tuple[str, str, int, int, int]]) -> dict[str, Any]:
    """For each ``(model, schedule, replicas, microbatches, batch)``: a pipeline of ``world /
    replicas`` stages, each stage replicated: one step's loss and every gradient equal the unsplit
    model's on the whole batch; the replicas hold equal weights after an SGD step; a forward
    gives the whole batch's output; a checkpoint merges into the model's state dict. Reports the
    predicted step and its all-reduce terms."""
    from fxsplit.schedule import plan_step_s

    out: dict[str, Any] = {}
    for name, schedule, replicas, m, batch in runs:
        tag = f"{name}/{schedule}/dp={replicas}/m={m}"
        case = _case(name, batch)
        inputs, target = case.make_batch(batch, 5)
        ref_loss, ref_grads = reference(case, inputs, target)
        # no state dict: each replica initialises its own stage, replica 0's values reach the others
        pipe = fxd.compile(_model_fn(name, batch), case.example_inputs, schedule=schedule, microbatches=m,
                           timeout_s=30, cost_model="analytic", options=CompileOptions(link=LinkSpec()),
                           replicas=replicas)
        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, pipe.state_dict())
        out[tag] = {"initial": [part for part in gathered]}
        merged = {k: v for part in gathered for k, v in part.items()}
        case.model.load_state_dict(merged)  # the reference starts where the stages do
        ref_loss, ref_grads = reference(case, inputs, target)
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
        out[tag].update(compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag))
        out[tag].update(broadcast=float(loss), stages=list(pipe.stage_indices), replica=pipe.replicas.index,
                        num_stages=pipe.num_stages, replica_sync_s=pipe.replica_sync_s, tied_sync_s=pipe.tied_sync_s,
                        predicted=pipe.predicted_step_s(), plan_step=float(plan_step_s(pipe.running_plan())))
        out[tag]["weights"] = forward_then_sgd(pipe, case, inputs)
        ckpt = os.path.join(out_dir, f"ckpt-{name}-{replicas}")
        pipe.save(ckpt)
        pipe.close()
    return out


def forward_then_sgd(pipe: Any, case: Any, inputs: Any) -> dict[str, torch.Tensor]:
    """Check the pipeline's forward against the unsplit model's (last rank), take one SGD step
    (lr 0.1) on this rank's parameters and return its state dict after it."""
    with torch.no_grad():
        y = pipe(*inputs)
        want = case.model(*inputs)
    if pipe.is_last:
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        for p in pipe.parameters():
            p -= 0.1 * p.grad
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def split_stages_equal(rank: int, world: int, out_dir: str,
                       runs: list[tuple[str, str, int, int, str, int, int]]) -> dict[str, Any]:
    """For each ``(model, schedule, replicas, tp, tp strategy, microbatches, batch)``: a pipeline whose stages
    are split over ``tp`` ranks (and replicated ``replicas`` times): one step's loss and every
    gradient equal the unsplit model's; the forward too; after SGD every copy of a stage holds
    the same whole weights; the checkpoint reloads onto 2 stages x 2 replicas unchanged."""
    out: dict[str, Any] = {}
    for name, schedule, replicas, tp, strategy, m, batch in runs:
        tag = f"{name}/{schedule}/dp={replicas}/tp={tp}/{strategy}/m={m}"
        case = _case(name, batch)
        inputs, target = case.make_batch(batch, 5)
        pipe = fxd.compile(_model_fn(name, batch), case.example_inputs, schedule=schedule, microbatches=m,
                           timeout_s=30, cost_model="analytic", options=CompileOptions(link=LinkSpec()),
                           replicas=replicas, tensor_parallel=tp, tp_strategy=strategy)
        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, pipe.state_dict())
        case.model.load_state_dict({k: v for part in gathered for k, v in part.items()})
        ref_loss, ref_grads = reference(case, inputs, target)
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
        out[tag] = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag)
        # the whole model's gradient norm: shards gathered, replicas and tied copies once
        ref_total = float(torch.nn.utils.clip_grad_norm_(case.model.parameters(), 0.05))
        clipped = {n: p.grad.clone() for n, p in case.model.named_parameters(remove_duplicate=False)}
        out[tag]["clip"] = (pipe.clip_grad_norm_(0.05), ref_total)
        compare(pipe, None, ref_loss, clipped, f"{tag}/clipped")
        split = {n: str(p.placements) for n, p in pipe.named_parameters() if isinstance(p, DTensor)}
        out[tag].update(broadcast=float(loss), stages=list(pipe.stage_indices), split=split, plan=pipe.tp_plan.strategy,
                        shard=pipe.replicas.tp_index, replica=pipe.replicas.index)
        out[tag]["weights"] = forward_then_sgd(pipe, case, inputs)
        ckpt = os.path.join(out_dir, f"ckpt-{name}-tp{tp}")
        pipe.save(ckpt)
        pipe.close()
        again = fxd.load(ckpt, _model_fn(name, batch), case.example_inputs, replicas=2, timeout_s=30,
                         cost_model="analytic", options=CompileOptions(link=LinkSpec()))
        every: list[Any] = [None] * world
        torch.distributed.all_gather_object(every, out[tag]["weights"])
        saved = {k: v for part in every for k, v in part.items()}  # the new layout holds other keys
        mine = again.state_dict()
        for key, value in mine.items():
            torch.testing.assert_close(value, saved[key], rtol=0, atol=0,
                                       msg=lambda msg, k=key, t=tag: f"{t}: {k} reloaded as 2 x 2: {msg}")
        out[tag]["reloaded"] = sorted(mine)
        again.close()
    return out


def hybrid_equal(rank: int, world: int, out_dir: str, name: str, batch: int, m: int) -> dict[str, Any]:
    """``compile(parallel="hybrid")``: rank 0 chooses the mesh; what every rank built, and one
    step's loss and every gradient against the unsplit model."""
    case = _case(name, batch)
    inputs, target = case.make_batch(batch, 5)
    ref_loss, ref_grads = reference(case, inputs, target)
    pipe = fxd.compile(_model_fn(name, batch), case.example_inputs, schedule="1f1b", microbatches=m,
                       state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                       options=CompileOptions(link=LinkSpec()), parallel="hybrid")
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
    out = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, name)
    # clipping by the whole model's norm: replicas and tensor-parallel shards count once
    ref_total = float(torch.nn.utils.clip_grad_norm_(case.model.parameters(), 0.05))
    clipped = {n: p.grad.clone() for n, p in case.model.named_parameters(remove_duplicate=False)}
    out["clip"] = (pipe.clip_grad_norm_(0.05), ref_total)
    compare(pipe, None, ref_loss, clipped, f"{name}/clipped")
    best = pipe.hybrid.best
    mesh = pipe.replicas
    out.update(best=(best.pp, best.dp, best.tp, best.family), layouts=len(pipe.hybrid.layouts),
               built=(pipe.num_stages, 1 if mesh is None else mesh.count, 1 if mesh is None else mesh.tp),
               microbatches=pipe.microbatches, broadcast=float(loss), costs=pipe.hybrid.costs)
    pipe.close()
    return out


def cli_hybrid(rank: int, world: int, out_dir: str) -> str:
    """``fxsplit compile gpt --distributed --parallel hybrid --calibrate 1`` (its body): what rank 0 prints."""
    import contextlib
    import io

    from fxsplit.cli.compile_dist import run_distributed

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_distributed("gpt", steps=2, microbatches="4", schedule="1f1b", size="tiny", batch_size=8, lr=0.1,
                        backend="gloo", timeout_s=60.0, parallel="hybrid", calibrate=1)
    return buf.getvalue()


def cli_replicas(rank: int, world: int, out_dir: str) -> str:
    """``fxsplit compile gpt --distributed --replicas 2`` (its body): what rank 0 prints."""
    import contextlib
    import io

    from fxsplit.cli.compile_dist import run_distributed

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_distributed("gpt", steps=2, microbatches="2", schedule="1f1b", size="tiny", batch_size=8, lr=0.1,
                        backend="gloo", timeout_s=60.0, replicas=2)
    return buf.getvalue()


def packed_boundary_equal(rank: int, world: int, out_dir: str, plan_json: str, runs: list[tuple[str, int, bool]],
                          batch: int) -> dict[str, Any]:
    """The zoo gpt cut right after an attention's ``chunk`` (``plan_json``): one train step per
    ``(schedule, microbatches, recompute)`` and a forward equal the unsplit model's; reports how
    this rank's boundary travels (wire tensors and messages)."""
    import dataclasses

    from fxsplit.ir import Plan

    case = _case("gpt", batch)
    inputs, target = case.make_batch(batch, 3)
    ref_loss, ref_grads = reference(case, inputs, target)
    out: dict[str, Any] = {}
    for schedule, m, recompute in runs:
        tag = f"packed/{schedule}/m={m}/recompute={recompute}"
        plan = Plan.from_json(plan_json).with_(schedule=schedule, microbatches=m)
        plan = plan.with_(stages=tuple(dataclasses.replace(st, recompute=recompute) for st in plan.stages))
        pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule=schedule, microbatches=m,
                           state_dict=case.model.state_dict(), timeout_s=30, plan=plan)
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        out[tag] = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag)
        module = pipe.module
        packing = module.out_packing if pipe.is_first else module.in_packing
        out[tag]["wire"] = len(packing.shapes) if packing is not None else None
        out[tag]["messages"] = len(packing.groups) if packing is not None else None
        out[tag]["recomputed"] = module.recomputed is not None
        got = pipe(*inputs)
        if pipe.is_last:
            with torch.no_grad():
                torch.testing.assert_close(got, case.model(*inputs), rtol=1e-4, atol=1e-5)
        pipe.close()
    return out


def clip_equal(rank: int, world: int, out_dir: str, name: str, batch: int, max_norm: float,
               norm_types: list[float]) -> dict[str, Any]:
    """For each norm type: one train step, then ``pipe.clip_grad_norm_``: the norm and every
    clipped gradient equal ``torch.nn.utils.clip_grad_norm_`` on the unsplit model (a tied
    embedding on two ranks)."""
    out: dict[str, Any] = {}
    for norm_type in norm_types:
        case = _case(name, batch)
        inputs, target = case.make_batch(batch, 5)
        ref = copy.deepcopy(case.model)
        ref_loss, _ = reference_of(ref, inputs, target, case.loss_fn)
        ref_total = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type))
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)}
        pipe = fxd.compile(_model_fn(name, batch), case.example_inputs, schedule="1f1b", microbatches=2,
                           state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                           options=CompileOptions(link=LinkSpec()))
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
        total = pipe.clip_grad_norm_(max_norm, norm_type)
        tag = f"clip/{name}/{norm_type}"
        out[tag] = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag)
        out[tag].update(total=total, ref_total=ref_total, tied=[t.name for t in pipe.tied])
        pipe.close()
    return out


def token_mean_refused(rank: int, world: int, out_dir: str, timeout_s: float) -> dict[str, Any]:
    """A token-mean cross-entropy over uneven padding (the micro-batches' losses weighted by
    samples are not the batch's): refused on the last rank, and no rank hangs or keeps a grad."""
    batch = 4
    case = _case("gpt", batch)
    pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="1f1b", microbatches=4,
                       state_dict=case.model.state_dict(), timeout_s=timeout_s, cost_model="analytic",
                       options=CompileOptions(link=LinkSpec()))
    inputs, target = case.make_batch(batch, 3)
    target = target.clone()
    target[3, 1:] = -100  # sample 3 (the last micro-batch) keeps one token: only the pair (2, 3) shows it

    def token_mean(out: Any, tgt: Any) -> Any:
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), tgt.flatten())

    start = time.monotonic()
    try:
        pipe.train_step(*inputs, target=target, loss_fn=token_mean)
    finally:
        with open(os.path.join(out_dir, f"elapsed{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start} {all(p.grad is None for p in pipe.parameters())}")
    return {"finished": True}


class _BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)
        self.l2, self.l3 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.bn(self.l1(x))))))


class _SeqFirst(torch.nn.Module):
    """A sequence-first encoder (``[seq, batch, d]``): attention mixes dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False)
        self.enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(src)))


def buffers_and_batch_mixing(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Three reliability cases (a probe found each silent): calibrate's timed steps left the
    BatchNorm statistics they updated; replicas with one micro-batch each were not checked for
    ops that mix samples and their running statistics drifted apart; the stand-in weights of the
    per-sample check hid attention over a sequence-first model's dim 0."""
    import warnings

    from fxsplit.errors import NotPerSampleWarning

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _BNNet()

    gen = torch.Generator().manual_seed(3)
    x, t = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    out: dict[str, Any] = {}
    original = {k: v.clone() for k, v in build().state_dict().items()}
    if world == 2:  # calibrate puts back what its steps changed
        pipe = fxd.compile(build, (x,), state_dict=original, microbatches=1, schedule="gpipe", cost_model="analytic",
                           timeout_s=60, options=CompileOptions(link=LinkSpec(), allow_idle_devices=False))
        pipe.calibrate(x, target=t, loss_fn=torch.nn.functional.mse_loss, steps=1, rounds=1)
        out["changed"] = [k for k, v in pipe.state_dict().items() if not torch.equal(v, original[k])]
        pipe.close()

        def seq_first() -> torch.nn.Module:
            torch.manual_seed(0)
            return _SeqFirst()

        src = torch.randn(6, 4, 8, generator=gen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = fxd.compile(seq_first, (src,), microbatches=2, schedule="gpipe", cost_model="analytic",
                               state_dict=seq_first().state_dict(), timeout_s=60,
                               options=CompileOptions(link=LinkSpec(), allow_idle_devices=False))
        out["seq_first_warned"] = [str(w.message) for w in caught if issubclass(w.category, NotPerSampleWarning)]
        pipe.close()
        return out
    ref = build()  # 2 stages x 2 replicas, one micro-batch each
    torch.nn.functional.mse_loss(ref(x), t).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = fxd.compile(build, (x,), state_dict=original, replicas=2, microbatches=1, schedule="gpipe",
                           cost_model="analytic", timeout_s=60,
                           options=CompileOptions(link=LinkSpec(), allow_idle_devices=False))
    out["replicas_warned"] = [str(w.message) for w in caught if issubclass(w.category, NotPerSampleWarning)]
    pipe.train_step(x, target=t, loss_fn=torch.nn.functional.mse_loss)
    mine = pipe.state_dict()
    out["running_mean"] = mine["bn.running_mean"].tolist() if "bn.running_mean" in mine else None
    out["ref_running_mean"] = ref.bn.running_mean.tolist()
    out["replica"] = pipe.replicas.index
    pipe.close()
    return out


def auto_one_microbatch(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """``microbatches="auto"`` with ``schedule="1f1b"`` on a model that is not per-sample: rank 0
    chooses one micro-batch, which torch's 1F1B refuses; it runs (as GPipe, the same actions)
    and trains as the unsplit model."""
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _BNNet()

    gen = torch.Generator().manual_seed(3)
    x, t = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    ref = build()
    ref_loss, ref_grads = reference_of(ref, (x,), t, torch.nn.functional.mse_loss)
    pipe = fxd.compile(build, (x,), state_dict=build().state_dict(), microbatches="auto", schedule="1f1b",
                       cost_model="analytic", timeout_s=60, options=CompileOptions(link=LinkSpec(), allow_idle_devices=False))
    loss = pipe.train_step(x, target=t, loss_fn=torch.nn.functional.mse_loss, broadcast_loss=True)
    out = compare(pipe, loss, ref_loss, ref_grads, "auto 1f1b, one micro-batch")
    out.update(microbatches=pipe.microbatches, schedule=pipe.schedule_kind)
    pipe.close()
    return out


def mode_checked(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """A pipeline compiled from a model in train mode (dropout on): ``eval()`` is refused (the
    captured graph keeps its dropout; it was a silent no-op), ``train()`` is accepted; from an
    eval-mode model the forward equals the unsplit model's in eval mode."""
    from fxsplit.errors import ConfigError

    def build(train: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
        return model.train(train)

    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for train in (True, False):
        pipe = fxd.compile(lambda t=train: build(t), (x,), microbatches=2, schedule="gpipe", timeout_s=30,
                           state_dict=build(train).state_dict(), cost_model="analytic",
                           options=CompileOptions(link=LinkSpec(), allow_idle_devices=False))
        try:
            pipe.train(not train)
            out[f"switch from {train}"] = None
        except ConfigError as exc:
            out[f"switch from {train}"] = str(exc)
        assert pipe.train(train) is pipe
        if not train:
            got = pipe(x)
            if pipe.is_last:
                with torch.no_grad():
                    torch.testing.assert_close(got, build(False)(x))
        pipe.close()
    return out


def loss_calls(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """``loss_fn`` calls on each of 5 steps of 4 micro-batches (a per-sample mean), and each
    step's loss against the unsplit model's."""
    batch = 8
    case = _case("gpt", batch)
    pipe = fxd.compile(_model_fn("gpt", batch), case.example_inputs, schedule="1f1b", microbatches=4,
                       state_dict=case.model.state_dict(), timeout_s=30, cost_model="analytic",
                       options=CompileOptions(link=LinkSpec()))
    inputs, target = case.make_batch(batch, 3)
    ref_loss, _ = reference_of(case.model, inputs, target, case.loss_fn)
    calls = [0]

    def counted(out: Any, tgt: Any) -> Any:
        calls[0] += 1
        return case.loss_fn(out, tgt)

    per_step = []
    for _ in range(5):
        calls[0] = 0
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(*inputs, target=target, loss_fn=counted, broadcast_loss=True)
        torch.testing.assert_close(float(loss), ref_loss, rtol=1e-5, atol=1e-6)
        per_step.append(calls[0])
    pipe.close()
    return {"calls": per_step}


def presharded_equal(rank: int, world: int, out_dir: str,
                     runs: list[tuple[str, str, int, int, bool, str]]) -> dict[str, Any]:
    """For each ``(model, schedule, replicas, tp, state dict as a file, recompute)``: a pipeline given the
    unsplit model's state dict (a mapping, or a file read with ``mmap``) reads each split weight
    as this rank's chunk alone (never allocated whole: the log counts the tensors held as this
    rank's chunk); one step's loss and every gradient equal the unsplit model's; the forward too."""
    import logging

    out: dict[str, Any] = {}
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logger = logging.getLogger("fxsplit.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for name, schedule, replicas, tp, as_file, recompute in runs:
        tag = f"{name}/{schedule}/dp={replicas}/tp={tp}/file={as_file}/recompute={recompute}"
        case = _case(name, 8)
        inputs, target = case.make_batch(8, 5)
        state: Any = case.model.state_dict()
        if as_file:
            state = os.path.join(out_dir, f"{name}-{rank}.pt")
            torch.save(case.model.state_dict(), state)
        ref_loss, ref_grads = reference(case, inputs, target)
        records.clear()
        pipe = fxd.compile(_model_fn(name, 8), case.example_inputs, schedule=schedule, microbatches=2,
                           state_dict=state, timeout_s=30, cost_model="analytic",
                           options=CompileOptions(link=LinkSpec(), recompute=recompute, allow_idle_devices=False),
                           replicas=replicas, tensor_parallel=tp, tp_strategy="megatron")
        runs_of_stage = [0]
        for st in pipe.stages:  # count the split stage's runs: forward, then again in backward
            if st.module.recomputed is not None:
                def counted(*a: Any, _run: Any = st.module.recomputed.run, _runs: list[int] = runs_of_stage) -> Any:
                    _runs[0] += 1
                    return _run(*a)
                st.module.recomputed.run = counted
        loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn, broadcast_loss=True)
        out[tag] = compare(pipe, loss if pipe.is_last else None, ref_loss, ref_grads, tag)
        out[tag]["stage_runs"] = runs_of_stage[0]
        with torch.no_grad():
            got = pipe(*inputs)
        if pipe.is_last:
            torch.testing.assert_close(got, case.model(*inputs), rtol=1e-5, atol=1e-6)
        out[tag]["origins"] = [r for r in records if "state from" in r]
        out[tag]["split"] = sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor))
        out[tag]["recomputed"] = [st.module.recomputed is not None for st in pipe.stages]
        pipe.close()
    logger.removeHandler(handler)
    return out
