"""Transparency on Hugging Face models (random weights from configs, nothing downloaded)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from pipeline_utils import Compiled, assert_same_training  # noqa: E402

import fxsplit.models as zoo  # noqa: E402

pytestmark = pytest.mark.hf
BATCH = 4


@pytest.fixture(scope="module", params=["bert", "gpt2", "vit", "llama"])
def compiled(request):
    return Compiled(zoo.hf(request.param, batch_size=BATCH))


@pytest.mark.parametrize(("num_stages", "schedule", "microbatches"), [(2, "gpipe", 2), (3, "1f1b", 4), (4, "1f1b", 2), (4, "gpipe", 4)])
def test_hf_model_trains_like_the_original(compiled, num_stages, schedule, microbatches):
    pipe = compiled.pipeline(num_stages, schedule, microbatches)
    assert pipe.num_stages == num_stages
    inputs, target = compiled.case.make_batch(BATCH, 11)
    assert_same_training(pipe, compiled, inputs, target)
    assert list(pipe.state_dict()) == list(compiled.reference.state_dict())


def test_keyword_inputs_reach_the_right_stage():
    case = zoo.hf("bert", batch_size=BATCH)
    compiled = Compiled(case, use_kwargs=True)
    pipe = compiled.pipeline(3, "1f1b", 2)
    ids = case.example_inputs[0]
    mask = case.example_kwargs["attention_mask"].clone()
    mask[:, -3:] = 0
    import torch

    from fxsplit.models import primary_tensor

    with torch.no_grad():
        torch.testing.assert_close(
            primary_tensor(pipe(ids, attention_mask=mask)), primary_tensor(compiled.reference(ids, attention_mask=mask))
        )


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_models_with_an_attention_mask_are_found_per_sample(name):
    """Regression (issue 10): the mask code of Hugging Face models indexes the samples with
    ``arange(batch)``, whose values differ between a batch and its half although every output is
    per-sample; the check named that ``arange`` and compile ran such models as one micro-batch.
    Only a node a differing output depends on is reported now."""
    from fxsplit.passes.per_sample import find_batch_mixing

    case = zoo.hf(name, batch_size=BATCH)
    compiled = Compiled(case, use_kwargs=True)
    cap = compiled.captured
    flat = cap.flatten_inputs(tuple(case.example_inputs), dict(case.example_kwargs or {}))
    assert any("arange" in n.name for n in cap.gm.graph.nodes), "no arange in the mask code: the test proves nothing"
    assert find_batch_mixing(cap.gm, flat, cap.batched_inputs) == []
