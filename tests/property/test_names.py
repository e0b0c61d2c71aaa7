"""Properties of parameter-name handling: wrappers, LoRA names, checkpoint pieces."""

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyworker.functional.names import (
    CheckpointPiece,
    canonical_name,
    check_pieces,
    drop_tied_lm_head,
    from_checkpoint,
    is_lora_param,
    lora_base_name,
    lora_module_name,
    pieces_by_checkpoint_name,
    to_checkpoint,
    whole_piece,
)
from tests.property.strategies import SEEDS, seeded_randn

segments = st.sampled_from(
    ["model", "layers", "0", "3", "self_attn", "q_proj", "mlp", "embed_tokens", "norm"]
)
dotted = st.lists(segments, min_size=1, max_size=5).map(".".join)
wrappers = st.sampled_from(["_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."])


@given(
    parts=st.lists(st.tuples(segments, st.lists(wrappers, max_size=2)), min_size=1, max_size=5),
    leading_module=st.booleans(),
)
def test_canonical_name_removes_every_wrapper_fragment_and_nothing_else(parts, leading_module):
    clean = ".".join(seg for seg, _ in parts)
    wrapped = ".".join("".join(ws) + seg for seg, ws in parts)
    if leading_module:
        wrapped = "module." + wrapped
    assert canonical_name(wrapped) == clean
    assert canonical_name(clean) == clean  # idempotent on clean names


@given(module=dotted, ab=st.sampled_from(["lora_A", "lora_B"]))
def test_lora_names_map_to_their_module_and_base_weight(module, ab):
    name = f"{module}.{ab}.weight"
    assert is_lora_param(name)
    assert lora_module_name(name) == module
    assert lora_base_name(name) == f"{module}.weight"
    assert not is_lora_param(f"{module}.weight")


def test_lora_module_name_rejects_plain_names():
    with pytest.raises(ValueError, match="not a LoRA adapter name"):
        lora_module_name("model.layers.0.q_proj.weight")


@given(names=st.lists(dotted, max_size=6), tied=st.booleans(), position=st.integers(0, 6))
def test_drop_tied_lm_head_removes_only_lm_head_and_only_when_tied(names, tied, position):
    names = [n for n in names if n != "lm_head.weight"]
    with_head = names[:position] + ["lm_head.weight"] + names[position:]
    out = drop_tied_lm_head(with_head, tie_word_embeddings=tied)
    assert out == (names if tied else with_head)


# ------------------------------------------------------------------ checkpoint pieces (views)


@st.composite
def partitioned_tensors(draw):
    """A random tensor and a random partition of it into views (what a checkpoint conversion
    cuts: experts unbound, halves chunked, some transposed), as CheckpointPieces."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    source = seeded_randn(draw(SEEDS), shape)
    views = [source]
    for _ in range(draw(st.integers(0, 4))):
        view = views.pop(draw(st.integers(0, len(views) - 1)))
        dims = [d for d in range(view.dim()) if view.shape[d] > 1]
        op = draw(st.sampled_from(["unbind", "chunk", "transpose"]))
        if op == "transpose" and view.dim() >= 2:
            a, b = draw(st.permutations(range(view.dim())))[:2]
            views.append(view.transpose(a, b))
        elif dims:
            dim = draw(st.sampled_from(dims))
            parts = view.unbind(dim) if op == "unbind" else view.chunk(draw(st.integers(2, 3)), dim)
            views.extend(parts)
        else:
            views.append(view)
    pieces = [
        CheckpointPiece(f"ckpt.{i}", tuple(v.shape), tuple(v.stride()), v.storage_offset())
        for i, v in enumerate(views)
    ]
    return source, views, pieces


@given(case=partitioned_tensors())
def test_pieces_cut_the_views_and_rebuild_the_source(case):
    source, views, pieces = case
    check_pieces("w", source.shape, pieces)
    cut = to_checkpoint(source, pieces)
    assert [n for n, _ in cut] == [p.name for p in pieces]
    for (_, got), want in zip(cut, views, strict=True):
        assert torch.equal(got, want)
        assert got.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()  # no copy
    rebuilt = from_checkpoint(source.shape, pieces, {n: t.clone() for n, t in cut})
    assert torch.equal(rebuilt, source)
    located = pieces_by_checkpoint_name({"w": pieces})
    assert all(located[p.name] == ("w", p) for p in pieces)


@given(case=partitioned_tensors())
def test_a_lost_or_out_of_bounds_piece_is_refused(case):
    source, _, pieces = case
    if len(pieces) > 1:
        with pytest.raises(ValueError, match="hold .* elements"):
            check_pieces("w", source.shape, pieces[1:])
    shifted = attrs.evolve(pieces[-1], offset=pieces[-1].offset + source.numel())
    with pytest.raises(ValueError, match="reaches outside 'w'"):
        check_pieces("w", source.shape, [*pieces[:-1], shifted])


@given(shape=st.lists(st.integers(1, 4), max_size=3).map(tuple), seed=SEEDS)
def test_a_whole_piece_is_the_tensor_itself(shape, seed):
    source = seeded_randn(seed, shape)
    piece = whole_piece("w", shape)
    assert piece.is_whole(shape) and piece.stride == source.stride()
    assert torch.equal(piece.view_of(source), source)
    if len(shape) >= 2 and shape[0] > 1 and shape[1] > 1:
        transposed = source.transpose(0, 1)
        with pytest.raises(ValueError, match="needs a contiguous source"):
            whole_piece("w", transposed.shape).view_of(transposed)


def test_one_checkpoint_name_from_two_sources_is_refused():
    piece = whole_piece("shared", (2,))
    with pytest.raises(ValueError, match="comes from both 'a' and 'b'"):
        pieces_by_checkpoint_name({"a": [piece], "b": [piece]})
