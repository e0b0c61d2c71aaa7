"""Eagle3 draft config.json layouts: where `eagle_aux_hidden_state_layer_ids` may sit.

vLLM's loader and published Eagle3 checkpoints put the ids at the top level of config.json, the
drafts this library saves put them under `eagle_config`, and a config may omit them (vLLM then
reads its default layers of the policy). All three load, in-process through a PolicyWorker with
`draft.model_name` too; anything else is a ValueError naming the key.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from policyworker.shell.model.draft_model import (
    AUX_IDS_KEY,
    default_aux_layers,
    eagle3_aux_layer_ids,
    eagle3_config,
    vllm_default_aux_ids,
)
from policyworker.shell.worker.policy_worker import PolicyWorker
from tests.shell.conftest import make_config

SOURCE = "draft/config.json"


def _ids(meta, layers=32):
    return eagle3_aux_layer_ids(meta, num_policy_layers=layers, source=SOURCE)


def test_the_ids_are_read_at_the_top_level_under_eagle_config_or_as_vllms_default():
    assert _ids({AUX_IDS_KEY: [2, 16, 29]}) == (2, 16, 29)
    assert _ids({"eagle_config": {AUX_IDS_KEY: [3, 17], "use_aux_hidden_state": True}}) == (3, 17)
    same = [2, 16, 29]
    assert _ids({AUX_IDS_KEY: same, "eagle_config": {AUX_IDS_KEY: same}}) == (2, 16, 29)
    assert _ids({}) == _ids({"eagle_config": {}}) == vllm_default_aux_ids(32) == (2, 16, 29)
    # vLLM's default, in the layers the ids leave, is this library's default pick of layers.
    assert tuple(i - 1 for i in vllm_default_aux_ids(32)) == default_aux_layers(32)


@pytest.mark.parametrize(
    ("meta", "layers", "match"),
    [
        ({AUX_IDS_KEY: "2,16,29"}, 32, rf"{AUX_IDS_KEY} = '2,16,29' must be a non-empty list"),
        ({AUX_IDS_KEY: []}, 32, rf"{AUX_IDS_KEY} = \[\] must be a non-empty list"),
        ({AUX_IDS_KEY: [0, 16]}, 32, r"distinct ints in 1\.\.32"),
        ({AUX_IDS_KEY: [2, 33]}, 32, r"distinct ints in 1\.\.32"),
        ({AUX_IDS_KEY: [2, 2, 29]}, 32, r"distinct ints"),
        ({AUX_IDS_KEY: [True, 16]}, 32, r"distinct ints"),
        ({AUX_IDS_KEY: [2.0, 16]}, 32, r"distinct ints"),
        ({"eagle_config": {AUX_IDS_KEY: [2, 40]}}, 32, rf"eagle_config\.{AUX_IDS_KEY} = "),
        ({"eagle_config": [2, 16]}, 32, r"'eagle_config' must be a mapping, got list"),
        (
            {AUX_IDS_KEY: [2, 16], "eagle_config": {AUX_IDS_KEY: [3, 17]}},
            32,
            rf"{AUX_IDS_KEY!r} is \[2, 16\] at the top level but \[3, 17\] under 'eagle_config'",
        ),
        ({}, 2, rf"{AUX_IDS_KEY} \(absent: vLLM's default for a 2-layer policy\) = \(2, 1, -1\)"),
    ],
)
def test_anything_else_is_refused_naming_the_key(meta, layers, match):
    with pytest.raises(ValueError, match=match) as refused:
        _ids(meta, layers)
    assert str(refused.value).startswith(f"{SOURCE}: ")


def _saved_draft(worker, folder, *, layout):
    """The worker's draft written as a draft folder, its ids in `layout` ('top', 'nested' or
    'absent'); returns the draft's state dict."""
    draft = worker.state.draft
    meta = eagle3_config(draft.model, draft.aux_layers)
    ids = meta.pop("eagle_config")[AUX_IDS_KEY]
    if layout == "top":
        meta[AUX_IDS_KEY] = ids
    elif layout == "nested":
        meta["eagle_config"] = {AUX_IDS_KEY: ids, "use_aux_hidden_state": True}
    folder.mkdir()
    state = {k: v.detach().clone().contiguous() for k, v in draft.model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(meta))
    return state


def test_a_worker_loads_a_draft_in_either_layout_and_refuses_one_it_cannot_place(
    tiny_model_paths, tmp_path
):
    path = tiny_model_paths["llama"]  # 2 decoder layers: the draft reads both
    source = PolicyWorker(make_config(path, train_global_batch_size=8, draft={}))
    assert source.state.draft.aux_layers == (0, 1)
    for layout in ("top", "nested"):
        state = _saved_draft(source, tmp_path / layout, layout=layout)
        cfg = make_config(
            path, train_global_batch_size=8, draft={"model_name": str(tmp_path / layout)}
        )
        loaded = PolicyWorker(cfg).state.draft
        assert loaded.aux_layers == (0, 1), layout
        got = loaded.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in state.items()), layout
    _saved_draft(source, tmp_path / "absent", layout="absent")
    cfg = make_config(
        path, train_global_batch_size=8, draft={"model_name": str(tmp_path / "absent")}
    )
    # vLLM's default for a 2-layer policy names layers it does not have: refused by the key.
    with pytest.raises(ValueError, match=rf"{AUX_IDS_KEY} \(absent: vLLM's default"):
        PolicyWorker(cfg)
    cfg = make_config(
        path,
        train_global_batch_size=8,
        draft={"model_name": str(tmp_path / "top"), "aux_layer_indices": [1]},
    )
    with pytest.raises(ValueError, match=r"reads policy layers \[0, 1\] but draft\.aux_layer"):
        PolicyWorker(cfg)


def test_a_draft_trained_on_other_layers_is_fed_those_layers(tiny_model_paths, tmp_path):
    path = tiny_model_paths["llama"]
    one = PolicyWorker(
        make_config(path, train_global_batch_size=8, draft={"aux_layer_indices": [1]})
    )
    _saved_draft(one, tmp_path / "late", layout="top")  # the ids: [2]
    cfg = make_config(path, train_global_batch_size=8, draft={"model_name": str(tmp_path / "late")})
    assert PolicyWorker(cfg).state.draft.aux_layers == (1,)  # not the default (0, 1)
