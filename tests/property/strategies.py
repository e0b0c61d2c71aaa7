"""Hypothesis strategies shared by the property tests of the functional core."""

import torch
from hypothesis import strategies as st

FLOAT_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])
SEEDS = st.integers(0, 2**31 - 1)


def seeded_randn(
    seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)


def seeded_randint(seed: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=generator)


@st.composite
def right_padded_batches(
    draw, *, max_batch: int = 6, max_len: int = 32, vocab: int = 1000, min_len: int = 0
):
    """(tokens_BS, lengths_B) with right padding (pad = -1), lengths in [min_len, S]."""
    seq_len = draw(st.integers(max(1, min_len), max_len))
    lengths = draw(st.lists(st.integers(min_len, seq_len), min_size=1, max_size=max_batch))
    lengths_B = torch.tensor(lengths)
    tokens_BS = seeded_randint(draw(SEEDS), vocab, (len(lengths), seq_len))
    mask_BS = torch.arange(seq_len)[None, :] < lengths_B[:, None]
    return tokens_BS.masked_fill(~mask_BS, -1), lengths_B


@st.composite
def cp_layouts(draw, *, max_cp: int = 8, max_chunk: int = 8):
    """(cp_size, seq_len): seq_len is built as a multiple of 2 * cp_size, not filtered."""
    cp_size = draw(st.integers(1, max_cp))
    return cp_size, 2 * cp_size * draw(st.integers(1, max_chunk))
