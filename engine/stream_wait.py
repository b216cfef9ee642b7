"""A signal word in page-locked host memory that a CUDA stream waits on: a host thread, or
another process sharing the memory, sets it (:meth:`HostSignal.set`), and work queued after
:meth:`HostSignal.stream_wait` runs only once the word has one of the bits waited for, without
any host thread blocking meanwhile (the driver's ``cuStreamWaitValue32``, which polls the host
memory from the device). Because the bits waited for are fixed when the wait is queued, the
wait can be captured into a CUDA graph and replayed with it. :func:`register_host_memory`
page-locks memory that torch did not allocate (a mapping shared with another process).

Invariant for whoever queues a wait: the thread that will set the bits must never need what
the waiting stream's work produces, nor the GIL of a thread that waits for that work while
holding it (torch's waits for the device release the GIL).
"""

import ctypes
import logging
from functools import cache

import numpy as np
import torch

logger = logging.getLogger("engine")

_WAIT_AND = 0x2  # CU_STREAM_WAIT_VALUE_AND: until (word & value) != 0


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
    the time the stream runs them and a signal in it can be waited on; False (logged) where
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


class HostSignal:
    """See the module docstring. Build with :meth:`create`."""

    def __init__(self, host: torch.Tensor, device_address: int, driver: ctypes.CDLL) -> None:
        self._host = host  # keeps the pinned memory alive
        self._word = host.numpy().view(np.uint32)
        self.address = device_address  # where the device reads the word
        self._driver = driver
        self._device = torch.cuda.current_device()

    @staticmethod
    def create(host: torch.Tensor, bits: int) -> "HostSignal | None":
        """A signal set to ``bits`` in ``host`` (one int32 in page-locked host memory) for the
        current CUDA device, checked by one wait on it; None (logged) where the driver does not
        offer stream waits on host memory."""
        driver = _driver()
        if driver is None:
            logger.warning("the CUDA driver has no cuStreamWaitValue32: the host waits instead")
            return None
        address = ctypes.c_uint64()
        status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(address),
                                                     ctypes.c_void_p(host.data_ptr()), 0)
        signal = HostSignal(host, address.value, driver)
        signal.set(bits)
        if status == 0:
            status = signal._wait(bits)
            torch.cuda.current_stream().synchronize()
        if status != 0:
            logger.warning("stream waits on host memory failed (CUDA error %d): the host waits "
                           "instead", status)
            return None
        return signal

    def set(self, bits: int) -> None:
        """Make the word ``bits`` (32 of them); any thread."""
        self._word[0] = bits & 0xFFFFFFFF

    def stream_wait(self, bits: int) -> None:
        """Make the current stream's later work (or, while it captures, the graph's) wait until
        the word has one of ``bits`` set."""
        status = self._wait(bits)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUDA error {status}")

    def _wait(self, bits: int) -> int:
        # the raw handle, as Triton's launcher reads it (``current_stream()`` builds a Stream)
        stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(self._device))
        return self._driver.cuStreamWaitValue32_v2(stream, self.address, bits & 0xFFFFFFFF,
                                                   _WAIT_AND)
