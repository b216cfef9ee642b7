"""Copies between the device KV cache and the host KV tier's memory (``--kv-offloading-size``).

The host pool is one uint8 tensor of ``[slots, 2, num_layers, block bytes per layer]``: each
slot one block, contiguous (pinned memory on CUDA, registered in place so that a large pool is
not rounded up to a power of two). :meth:`KVTransfer.run` takes one step's copies, the stores
(device block → host slot) first, then the loads (host slot → device block), and must be called
before the step's forward:

- stores gather their blocks from the cache on a side stream that first waits for the compute
  stream (the blocks' KV is complete), into a block-major staging tensor; the compute stream
  waits only for that gather (device to device: its blocks may be written again from this step
  on), while the device → host copies run on behind later steps. A host slot becomes findable
  once :meth:`KVTransfer.poll` reports its copy done.
- loads copy their slots into a staging tensor and scatter it into the cache with one
  ``index_copy_`` on the compute stream, ahead of the forward that reads them; the host does
  not wait for either.

On CPU the same steps are plain synchronous copies (one gather, one ``index_copy_``).
"""

import logging
import time
import weakref
from collections import deque

import torch

logger = logging.getLogger("engine.kv_transfer")

STAGING_BYTES = 512 << 20  # device staging per chunk of stores


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(index, first slot, length)`` of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            index, first, length = runs[-1]
            runs[-1] = (index, first, length + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def _host_tensor(shape: tuple[int, ...], pinned: bool) -> torch.Tensor:
    host = torch.empty(shape, dtype=torch.uint8)
    if not pinned:
        return host
    start = time.perf_counter()
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)) != 0:
        logger.warning("cudaHostRegister failed; allocating the host KV tier as pinned memory")
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
    ptr = host.data_ptr()
    weakref.finalize(host, cudart.cudaHostUnregister, ptr)
    logger.info("pinned %.1f GiB of host KV tier in %.1fs", host.numel() / 2**30,
                time.perf_counter() - start)
    return host


class KVTransfer:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        self.device = kv_cache.device
        self.cuda = self.device.type == "cuda"
        two, layers, num_blocks = kv_cache.shape[:3]
        self.raw = kv_cache.view(torch.uint8).view(two, layers, num_blocks, -1)
        self.block_shape = (two, layers, self.raw.shape[3])
        self.bytes_per_block = two * layers * self.raw.shape[3]
        self.host = _host_tensor((num_slots, *self.block_shape), self.cuda)
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.chunk = max(1, STAGING_BYTES // self.bytes_per_block)
        self._stores: deque[tuple[torch.cuda.Event | None, list[int]]] = deque()
        self._loads: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.num_stored = 0
        self.num_loaded = 0
        self.load_seconds = 0.0

    @staticmethod
    def num_slots(bytes_per_block: int, gib: float) -> int:
        return int(gib * 2**30) // bytes_per_block

    @property
    def bytes_stored(self) -> int:
        return self.num_stored * self.bytes_per_block

    @property
    def bytes_loaded(self) -> int:
        return self.num_loaded * self.bytes_per_block

    def counters(self) -> dict[str, int | float]:
        """``EngineStats``' transfer fields."""
        return {"num_blocks_offloaded": self.num_stored, "num_blocks_reloaded": self.num_loaded,
                "kv_offload_bytes": self.bytes_stored, "kv_reload_bytes": self.bytes_loaded,
                "kv_reload_seconds": self.load_seconds}

    def _index(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.long)
        if not self.cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Issue one step's copies: ``(device block, host slot)`` stores, then
        ``(host slot, device block)`` loads (see the module docstring)."""
        if stores:
            self._store([b for b, _ in stores], [s for _, s in stores])
            self.num_stored += len(stores)
        if loads:
            self._load([s for s, _ in loads], [b for _, b in loads])
            self.num_loaded += len(loads)

    def _store(self, blocks: list[int], slots: list[int]) -> None:
        if not self.cuda:
            self.host[self._index(slots)] = self.raw[:, :, self._index(blocks)].movedim(2, 0)
            self._stores.append((None, slots))
            return
        assert self.side is not None
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        gathered, done = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self.side):
            for start in range(0, len(blocks), self.chunk):
                part = slice(start, start + self.chunk)
                staging = self.raw[:, :, self._index(blocks[part])].movedim(2, 0).contiguous()
                if start + self.chunk >= len(blocks):
                    gathered.record(self.side)
                for i, first, n in _runs(slots[part]):
                    self.host[first:first + n].copy_(staging[i:i + n], non_blocking=True)
            done.record(self.side)
        main.wait_event(gathered)
        self._stores.append((done, slots))

    def _load(self, slots: list[int], blocks: list[int]) -> None:
        if not self.cuda:
            start = time.perf_counter()
            self.raw.index_copy_(2, self._index(blocks), self.host[self._index(slots)]
                                 .movedim(0, 2))
            self.load_seconds += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        staging = torch.empty((len(slots), *self.block_shape), dtype=torch.uint8,
                              device=self.device)
        for i, first, n in _runs(slots):
            staging[i:i + n].copy_(self.host[first:first + n], non_blocking=True)
        self.raw.index_copy_(2, self._index(blocks), staging.movedim(0, 2))
        end.record()
        self._loads.append((begin, end))

    def poll(self) -> list[int]:
        """Host slots whose stores have completed since the last call (oldest first); also
        adds the completed loads' device time to ``load_seconds``."""
        done: list[int] = []
        while self._stores and (self._stores[0][0] is None or self._stores[0][0].query()):
            done += self._stores.popleft()[1]
        while self._loads and self._loads[0][1].query():
            begin, end = self._loads.popleft()
            self.load_seconds += begin.elapsed_time(end) / 1e3
        return done
