"""The parity check's judging of an EAGLE 3.1 folder (eagle3/tools/parity/check.py), without an engine:
the switches an engine built from config.json against the trained ones, and a trained `fc_norm`
tensor the folder lacks or holds under another name. tests/stages/test_engine_parity.py plants
the same defects in real folders and runs both engines' own classes on them."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.shape import shape_switches
from eagle3.tools.parity.check import load_findings, reference_from_drafter, shape_findings, weight_findings
from eagle3.tools.parity.protocol import built_shape

LAYERS = [2, 4, 5]
SMALL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
             target_hidden_size=64, draft_vocab_size=100, target_vocab_size=100, max_position_embeddings=2048)


def reference(shape: str = "eagle3.1", seed: int = 0):
    drafter = Eagle3Drafter(DrafterConfig(**SMALL, **shape_switches(shape)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))  # away from an RMSNorm's initial ones
    return reference_from_drafter(drafter, LAYERS, dtype="float32")


def fields(findings) -> dict[str, str]:
    return {f["field"]: f["message"] for f in findings if f["level"] == "error"}


def test_an_engine_that_built_the_trained_switches_gives_no_shape_finding():
    assert shape_findings(reference("eagle3.1"), {"fc_norm": 3, "norm_output": True}, {}) == []
    assert shape_findings(reference("eagle3"), {"fc_norm": 0, "norm_output": False}, {}) == []


def test_switches_the_engine_did_not_build_are_named_with_the_key_to_write():
    found = fields(shape_findings(reference("eagle3.1"), {"fc_norm": 0, "norm_output": False}, {"fc_norm": True}))
    assert set(found) == {"fc_norm", "norm_output"}
    assert "the engine builds no fc_norm (config.json has fc_norm = true)" in found["fc_norm"]
    assert 'write "fc_norm": true' in found["fc_norm"]
    assert "its pre-norm output (config.json has norm_output = null)" in found["norm_output"]
    assert 'trained on the post-norm one: write "norm_output": true' in found["norm_output"]


def test_switches_an_engine_built_beyond_training_say_drop_the_key():
    found = fields(shape_findings(reference("eagle3"), {"fc_norm": 3, "norm_output": True},
                                  {"fc_norm": True, "norm_output": True}))
    assert "trained without fc_norm: drop the key" in found["fc_norm"]
    assert "post-norm output" in found["norm_output"] and "drop the key" in found["norm_output"]


def test_an_fc_norm_count_other_than_the_aux_layers_names_the_key_that_sets_it():
    found = fields(shape_findings(reference("eagle3.1"), {"fc_norm": 4, "norm_output": True}, {}))
    assert list(found) == ["fc_norm"]
    assert "builds 4 fc_norm norms, the drafter was trained on 3 aux layers" in found["fc_norm"]
    assert "eagle_aux_hidden_state_layer_ids" in found["fc_norm"]


def test_built_shape_reads_both_engines_inner_model_and_a_release_before_eagle31():
    inner = SimpleNamespace(fc_norm=nn.ModuleList(nn.Identity() for _ in range(3)), norm_output=True)
    assert built_shape(inner) == {"fc_norm": 3, "norm_output": True}
    assert built_shape(SimpleNamespace(fc_norm=None, norm_output=False)) == {"fc_norm": 0, "norm_output": False}
    assert built_shape(SimpleNamespace()) == {"fc_norm": 0, "norm_output": False}  # neither attribute


def _as_engine_holds_it(ref, folder: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an engine holds after loading `folder`: each trained tensor the folder has, an
    RMSNorm's initial ones for a norm it lacks."""
    return {n: folder.get(n, torch.ones_like(t)) for n, t in ref.weights().items()}


def test_a_dropped_fc_norm_tensor_is_named_as_missing_from_the_folder():
    ref = reference()
    folder = {n: t for n, t in ref.weights().items() if n != "fc_norm.1.weight"}
    found = fields(weight_findings(ref, _as_engine_holds_it(ref, folder), folder))
    assert list(found) == ["fc_norm.1.weight"]
    assert found["fc_norm.1.weight"] == ("the folder has no fc_norm.1.weight, which was trained ([64]): export every "
                                         "trained tensor (stage 05)")


def test_a_renamed_fc_norm_tensor_is_found_under_its_other_name():
    ref = reference()
    folder = {n.replace("fc_norm.", "fc_norms."): t for n, t in ref.weights().items()}
    found = fields(weight_findings(ref, _as_engine_holds_it(ref, folder), folder))
    assert set(found) == {f"fc_norm.{i}.weight" for i in range(3)}
    assert "its trained values are in the folder as fc_norms.2.weight, which the engine does not read: write " \
           "them as fc_norm.2.weight" in found["fc_norm.2.weight"]
    # a loader that refused the other name says so, naming the trained tensor it stood for
    error = {"where": "load_weights", "message": "ValueError: no fc_norms",
             "tensors": {f"fc_norms.{i}.weight": "ValueError" for i in range(3)}}
    found = fields(load_findings(ref, error, folder))
    assert "in the folder as fc_norms.0.weight, which the loader refused" in found["fc_norm.0.weight"]
    assert "fc_norms.0.weight" in found  # the refused tensor itself, as before
