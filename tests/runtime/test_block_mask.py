"""_split_block_mask (torch's name, imported by torchtitan): chunks equal torch's, offsets kept."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from pipetrain.errors import PipelineError
from pipetrain.microbatch import _split_block_mask


def _mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return ((q >= kv) & (b % 2 == 0)) | (q == kv)


def test_chunks_equal_torchs_and_see_their_place_in_the_batch() -> None:
    import torch.distributed.pipelining.microbatch as theirs

    block_mask = create_block_mask(_mask, 5, None, 256, 256, device="cpu")
    mine = _split_block_mask(block_mask, 2)
    ref = theirs._split_block_mask(block_mask, 2)
    assert [c.kv_num_blocks.shape[0] for c in mine] == [3, 2]
    t = torch.tensor
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a.kv_num_blocks, b.kv_num_blocks)
        torch.testing.assert_close(a.kv_indices, b.kv_indices)
        for local in range(a.kv_num_blocks.shape[0]):
            assert bool(a.mask_mod(t(local), t(0), t(5), t(1))) == bool(b.mask_mod(t(local), t(0), t(5), t(1)))
    # batch row 3 is the second chunk's row 0: odd, so only the diagonal
    assert not bool(mine[1].mask_mod(t(0), t(0), t(5), t(1))) and bool(mine[0].mask_mod(t(2), t(0), t(5), t(1)))


def test_batch_one_is_shared_and_bad_counts_are_named() -> None:
    block_mask = create_block_mask(_mask, 1, None, 128, 128, device="cpu")
    assert _split_block_mask(block_mask, 3) == [block_mask] * 3
    with pytest.raises(PipelineError, match="num_chunks must be an integer >= 1"):
        _split_block_mask(block_mask, 0)
    two = create_block_mask(_mask, 2, None, 128, 128, device="cpu")
    with pytest.raises(PipelineError, match="batch 2 cannot be split into 3"):
        _split_block_mask(two, 3)
