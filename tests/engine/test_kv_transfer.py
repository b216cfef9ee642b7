"""``KVTransfer`` round trips: device blocks stored into host slots and loaded back into other
device blocks hold exactly the bytes they left with, while the compute stream keeps writing the
blocks they came from (CPU here; CUDA with its side stream and events where a GPU is present)."""

import pytest
import torch

from engine.kv_transfer import KVTransfer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _wait_for_stores(transfer: KVTransfer, slots: list[int]) -> None:
    done: list[int] = []
    while len(done) < len(slots):
        done += transfer.poll()
        if transfer.cuda:
            torch.cuda.synchronize()
    assert sorted(done) == sorted(slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_come_back_byte_for_byte_into_other_blocks(device: str, dtype) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    # [2, layers, blocks, block_size, kv_heads, head_dim]
    cache = torch.randn(2, 3, 24, 16, 2, 8, generator=gen, device=device).to(dtype)
    transfer = KVTransfer(cache, num_slots=10)
    blocks, slots = [3, 5, 6, 7, 20], [4, 0, 1, 2, 9]  # runs and gaps on both sides
    original = cache[:, :, blocks].clone()
    transfer.run(stores=list(zip(blocks, slots, strict=True)), loads=[])
    cache[:, :, blocks] = 0  # the compute stream reuses the blocks at once
    _wait_for_stores(transfer, slots)
    targets = [10, 11, 2, 13, 0]
    transfer.run(stores=[], loads=list(zip(slots, targets, strict=True)))
    assert torch.equal(cache[:, :, targets].view(torch.uint8), original.view(torch.uint8))
    assert transfer.num_stored == transfer.num_loaded == 5
    assert transfer.bytes_loaded == 5 * transfer.bytes_per_block
