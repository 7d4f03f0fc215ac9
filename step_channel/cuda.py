"""The step channel as the GPU sees it: registered, device-mapped, waited on from a stream.

`MappedChannel.register(channel)` pins the shared-memory region with
``cuMemHostRegister(DEVICEMAP | PORTABLE)``; the GPU then reads masks and writes tokens and
sequence numbers straight into it, and a stream can wait on a sequence word with
``cuStreamWaitValue32`` and write one with ``cuStreamWriteValue32`` (also inside a CUDA
graph: both become memop nodes).

The driver is reached through ``cuda.bindings.driver`` when it is installed, else through
``libcuda.so.1`` with ctypes. Without a driver, `cuda_available()` is False and
`MappedChannel.register` raises `CudaUnavailable`; the engine then waits and publishes from
the host (`StepChannel.wait_seq` / `publish_seq`).

Teardown order (NOTE: the reverse breaks): destroy every CUDA graph that reads or writes the
region, synchronize, `MappedChannel.close()` (unregister), then `StepChannel.close()`
(unmap / unlink). A graph replayed after unregister touches unmapped device addresses.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

from step_channel.layout import EntryLayout, entry_offset, region_bytes
from step_channel.region import StepChannel

log = logging.getLogger(__name__)

# Driver API constants (cuda.h); identical in every CUDA 11+/12+/13 driver.
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
WAIT_GEQ = 0x0   # (int32)(*addr - value) >= 0, wrap-safe like `seq_reached`
WAIT_EQ = 0x1
WAIT_AND = 0x2   # (*addr & value) != 0
WAIT_NOR = 0x3   # ~(*addr | value) != 0
WAIT_FLUSH = 1 << 30
WRITE_DEFAULT = 0x0  # a system-wide memory fence precedes the write


class CudaUnavailable(RuntimeError):
    """No CUDA driver (or no device) in this process: use the host wait/publish path."""


class _Driver:
    """The five driver calls the channel needs, over cuda.bindings or ctypes libcuda."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-not-found]
            self._cu, self.backend = cu, "cuda.bindings"
            return
        except ImportError:
            self._cu = None
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaUnavailable(f"no CUDA driver: {exc}") from None
        self.backend = "ctypes"
        lib = self._lib
        u32, u64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
        lib.cuMemHostRegister_v2.argtypes = [vp, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(u64), vp, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [vp]
        lib.cuStreamWaitValue32_v2.argtypes = [vp, u64, u32, ctypes.c_uint]
        lib.cuStreamWriteValue32_v2.argtypes = [vp, u64, u32, ctypes.c_uint]

    def _check(self, result, what: str):
        if self._cu is not None:
            err = result[0] if isinstance(result, tuple) else result
            if err != self._cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"{what} failed: {err}")
            return result[1] if isinstance(result, tuple) and len(result) > 1 else None
        if result != 0:
            raise RuntimeError(f"{what} failed: CUresult {result}")
        return None

    def make_context_current(self, device: int) -> None:
        """Make `device`'s primary context (torch's) current on this thread if none is. NOTE: a
        thread that made no CUDA runtime call has none (structgen serve builds the engine in a
        helper thread and starts it in the main one), and driver calls there fail with
        CUDA_ERROR_INVALID_CONTEXT; the runtime binds it lazily, the driver never does."""
        if self._cu is not None:
            cu = self._cu
            if not int(self._check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent") or 0):
                dev = self._check(cu.cuDeviceGet(device), "cuDeviceGet")
                self._check(cu.cuCtxSetCurrent(self._check(cu.cuDevicePrimaryCtxRetain(dev),
                                                           "cuDevicePrimaryCtxRetain")), "cuCtxSetCurrent")
            return
        lib, ctx = self._lib, ctypes.c_void_p()
        self._check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self._check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def host_register(self, host_ptr: int, nbytes: int) -> int:
        flags = CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE
        if self._cu is not None:
            self._check(self._cu.cuMemHostRegister(host_ptr, nbytes, flags), "cuMemHostRegister")
            return int(self._check(self._cu.cuMemHostGetDevicePointer(host_ptr, 0),
                                   "cuMemHostGetDevicePointer"))
        self._check(self._lib.cuMemHostRegister_v2(host_ptr, nbytes, flags), "cuMemHostRegister")
        dptr = ctypes.c_uint64()
        self._check(self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host_ptr, 0),
                    "cuMemHostGetDevicePointer")
        return dptr.value

    def host_unregister(self, host_ptr: int) -> None:
        if self._cu is not None:
            self._check(self._cu.cuMemHostUnregister(host_ptr), "cuMemHostUnregister")
        else:
            self._check(self._lib.cuMemHostUnregister(host_ptr), "cuMemHostUnregister")

    def wait_value32(self, stream: int, dptr: int, value: int, flags: int) -> None:
        value &= 0xFFFFFFFF
        if self._cu is not None:
            self._check(self._cu.cuStreamWaitValue32(stream, dptr, value, flags), "cuStreamWaitValue32")
        else:
            self._check(self._lib.cuStreamWaitValue32_v2(stream, dptr, value, flags),
                        "cuStreamWaitValue32")

    def write_value32(self, stream: int, dptr: int, value: int, flags: int = WRITE_DEFAULT) -> None:
        value &= 0xFFFFFFFF
        if self._cu is not None:
            self._check(self._cu.cuStreamWriteValue32(stream, dptr, value, flags), "cuStreamWriteValue32")
        else:
            self._check(self._lib.cuStreamWriteValue32_v2(stream, dptr, value, flags),
                        "cuStreamWriteValue32")


_DRIVER: _Driver | None = None


def driver() -> _Driver:
    """The process-wide driver handle (raises CudaUnavailable without CUDA)."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    try:
        driver()
    except CudaUnavailable:
        return False
    return True


@dataclass
class _CudaArray:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to alias a device pointer."""

    ptr: int
    num_elements: int

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.num_elements,), "typestr": "<i4", "data": (self.ptr, False),
                "version": 3, "strides": None}


def _stream_handle(stream) -> int:
    """A torch.cuda.Stream, a raw handle, or None (torch's current stream)."""
    if stream is None:
        import torch
        return torch.cuda.current_stream().cuda_stream
    return int(getattr(stream, "cuda_stream", stream))


class MappedChannel:
    """A StepChannel registered with the CUDA driver. `close()` before the channel closes."""

    def __init__(self, channel: StepChannel, host_ptr: int, device_ptr: int, nbytes: int) -> None:
        self.channel = channel
        self.host_ptr = host_ptr
        self.device_ptr = device_ptr
        self.nbytes = nbytes
        self._words = None  # lazily built torch view of the whole region

    @classmethod
    def register(cls, channel: StepChannel) -> "MappedChannel":
        """Pin and map the region for the current CUDA context (torch's primary context)."""
        try:
            import torch
        except ImportError:
            raise CudaUnavailable("torch is not installed") from None
        if not torch.cuda.is_available():
            raise CudaUnavailable("no CUDA device")
        torch.cuda.init()
        driver().make_context_current(torch.cuda.current_device())
        nbytes = region_bytes(channel.geometry)
        host_ptr = channel.buffer.ctypes.data  # mmap: page-aligned, nbytes a multiple of 4096
        device_ptr = driver().host_register(host_ptr, nbytes)
        log.info("registered step channel %s: %d bytes, host %#x -> device %#x (%s)",
                 channel.name, nbytes, host_ptr, device_ptr, driver().backend)
        return cls(channel, host_ptr, device_ptr, nbytes)

    def close(self) -> None:
        """Unregister. Every graph that touches the region must be destroyed before this."""
        if self.host_ptr:
            self._words = None
            import torch
            driver().make_context_current(torch.cuda.current_device())
            driver().host_unregister(self.host_ptr)
            self.host_ptr = self.device_ptr = 0

    def __enter__(self) -> "MappedChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- device addresses -------------------------------------------------------------
    def seq_ptr(self, which: str) -> int:
        return self.device_ptr + self.channel.seq_offset(which)

    def part_ptr(self, step: int, part: str) -> int:
        """Device address of `part` (an EntryLayout field) of the entry that holds `step`."""
        g = self.channel.geometry
        return self.device_ptr + entry_offset(g, step) + getattr(EntryLayout.for_geometry(g), part)

    # ---- torch views (int32, on the device, aliasing the mapped region) ---------------
    def words(self):
        """The whole region as one int32 CUDA tensor; all other views derive from it."""
        if self._words is None:
            import torch
            self._words = torch.as_tensor(_CudaArray(self.device_ptr, self.nbytes // 4), device="cuda")
        return self._words

    def seq_view(self, which: str):
        off = self.channel.seq_offset(which) // 4
        return self.words()[off:off + 1]

    def ring_view(self, part: str, shape: tuple[int, ...]):
        """(depth, *shape) strided view of one part across all ring entries (index = step % depth)."""
        return ring_view(self.words(), self.channel.geometry, part, shape)

    def mask_rows(self, step: int):
        """(max_rows, mask_words) int32 masks of the entry that holds `step`."""
        g = self.channel.geometry
        return self.ring_view("masks", (g.max_rows, g.mask_words))[step % g.depth]

    # ---- stream memory operations (capturable) ----------------------------------------
    def wait_value32(self, stream, which: str, value: int, flags: int = WAIT_GEQ) -> None:
        """Block `stream` until the sequence word satisfies `flags` against `value`."""
        driver().wait_value32(_stream_handle(stream), self.seq_ptr(which), value, flags)

    def write_value32(self, stream, which: str, value: int) -> None:
        """Write `value` into the sequence word from `stream`, after a system-wide fence."""
        driver().write_value32(_stream_handle(stream), self.seq_ptr(which), value, WRITE_DEFAULT)


def ring_view(words, geometry, part: str, shape: tuple[int, ...]):
    """(depth, *shape) view of `part` in every ring entry of a flat int32 tensor of the region.

    Works for CUDA-mapped words and for a CPU tensor over the same bytes (tests, host mode).
    """
    import torch
    layout = EntryLayout.for_geometry(geometry)
    entry_words = layout.size // 4
    start = (entry_offset(geometry, 0) + getattr(layout, part)) // 4
    inner = []
    stride = 1
    for dim in reversed(shape):
        inner.insert(0, stride)
        stride *= dim
    return torch.as_strided(words, (geometry.depth, *shape), (entry_words, *inner), start)


def host_words(channel: StepChannel):
    """The region as one int32 CPU tensor (no copy): the host-mode twin of `MappedChannel.words`."""
    import torch
    return torch.from_numpy(channel.buffer.view("int32"))
