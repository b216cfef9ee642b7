"""A counter in page-locked host memory that a CUDA stream waits on: a host thread, or
another process sharing the memory, raises it (:meth:`HostCounter.raise_to`), and work queued
after :meth:`HostCounter.stream_wait` runs only once the counter has reached the value waited
for, without any host thread blocking meanwhile (the driver's ``cuStreamWaitValue32``, which
polls the host memory from the device). :func:`register_host_memory` page-locks memory that
torch did not allocate (a mapping shared with another process).

The counter is 32 bits and compared cyclically (``(int32)(counter - value) >= 0``), so it may
wrap. Invariant for whoever queues a wait: the thread that will raise the counter must never
need what the waiting stream's work produces, nor the GIL of a thread that waits for that work
while holding it (torch's waits for the device release the GIL).
"""

import ctypes
import logging
from functools import cache

import numpy as np
import torch

logger = logging.getLogger("engine")

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


@cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library with the two entry points used here typed; None where it lacks
    them."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        wait = lib.cuStreamWaitValue32_v2
        device_pointer = lib.cuMemHostGetDevicePointer_v2
        register = lib.cuMemHostRegister_v2
        unregister = lib.cuMemHostUnregister
    except (OSError, AttributeError):
        return None
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait.restype = ctypes.c_int
    device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    device_pointer.restype = ctypes.c_int
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    register.restype = ctypes.c_int
    unregister.argtypes = [ctypes.c_void_p]
    unregister.restype = ctypes.c_int
    return lib


_REGISTER_PORTABLE_DEVICEMAP = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | _DEVICEMAP


def register_host_memory(memory: torch.Tensor) -> bool:
    """Page-lock and map for the device the host memory under the contiguous CPU tensor
    ``memory`` (until :func:`unregister_host_memory`), so that copies from it are DMA reads at
    the time the stream runs them and a counter in it can be waited on; False (logged) where
    the driver refuses."""
    driver = _driver()
    status = (driver.cuMemHostRegister_v2(ctypes.c_void_p(memory.data_ptr()),
                                          memory.numel() * memory.element_size(),
                                          _REGISTER_PORTABLE_DEVICEMAP)
              if driver is not None else -1)
    if status != 0:
        logger.warning("host memory could not be page-locked (CUDA error %d): the host waits "
                       "instead", status)
    return status == 0


class _DeviceMapped:
    """Host memory by its device address, for ``torch.as_tensor`` (the CUDA array interface);
    holds ``owner``, the CPU tensor over the same memory."""

    def __init__(self, address: int, owner: torch.Tensor) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(owner.shape), "typestr": owner.numpy().dtype.str,
            "data": (address, False), "strides": None, "version": 2}


def device_view(memory: torch.Tensor) -> torch.Tensor | None:
    """A CUDA tensor over the memory of the contiguous CPU tensor ``memory``, page-locked and
    mapped for the current device (:func:`register_host_memory`, or torch's pinned memory):
    kernels that read it read host memory over the bus, at the time they run, without a copy.
    Valid while that memory stays mapped. None (logged) where the driver gives no device
    address for it."""
    driver = _driver()
    address = ctypes.c_uint64()
    status = (driver.cuMemHostGetDevicePointer_v2(ctypes.byref(address),
                                                  ctypes.c_void_p(memory.data_ptr()), 0)
              if driver is not None else -1)
    if status != 0:
        logger.warning("host memory has no device address (CUDA error %d): it is copied "
                       "instead", status)
        return None
    return torch.as_tensor(_DeviceMapped(address.value, memory), device="cuda")


def unregister_host_memory(memory: torch.Tensor) -> None:
    """Undo :func:`register_host_memory` (no copy or kernel that reads ``memory`` may still be
    queued)."""
    driver = _driver()
    assert driver is not None
    driver.cuMemHostUnregister(ctypes.c_void_p(memory.data_ptr()))


class HostCounter:
    """See the module docstring. Build with :meth:`create`."""

    def __init__(self, host: torch.Tensor, device_address: int, driver: ctypes.CDLL) -> None:
        self._host = host  # keeps the pinned memory alive
        self._value = host.numpy().view(np.uint32)
        self._address = device_address
        self._driver = driver
        self._device = torch.cuda.current_device()

    @staticmethod
    def create(host: torch.Tensor) -> "HostCounter | None":
        """A counter at 0 in ``host`` (one int32 in page-locked host memory) for the current
        CUDA device, checked by one wait on it; None (logged) where the driver does not offer
        stream waits on host memory."""
        driver = _driver()
        if driver is None:
            logger.warning("the CUDA driver has no cuStreamWaitValue32: the host waits instead")
            return None
        host.zero_()
        address = ctypes.c_uint64()
        status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(address),
                                                     ctypes.c_void_p(host.data_ptr()), 0)
        counter = HostCounter(host, address.value, driver)
        if status == 0:
            status = counter._wait(0)
            torch.cuda.current_stream().synchronize()
        if status != 0:
            logger.warning("stream waits on host memory failed (CUDA error %d): the host waits "
                           "instead", status)
            return None
        return counter

    @property
    def value(self) -> int:
        return int(self._value[0])

    def raise_to(self, value: int) -> None:
        """Set the counter to ``value`` (wrapped to 32 bits); any thread."""
        self._value[0] = value & 0xFFFFFFFF

    def stream_wait(self, value: int) -> None:
        """Make the current stream's later work wait until the counter reaches ``value``."""
        status = self._wait(value)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUDA error {status}")

    def _wait(self, value: int) -> int:
        # the raw handle, as Triton's launcher reads it (``current_stream()`` builds a Stream)
        stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(self._device))
        return self._driver.cuStreamWaitValue32_v2(stream, self._address,
                                                   value & 0xFFFFFFFF, _WAIT_GEQ)
