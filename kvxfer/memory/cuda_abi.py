"""The CUDA driver's codes, flags, structures and callback types, as ctypes declares them (``cuda_driver``)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_size_t, c_uint, c_uint64, c_void_p

IPC_HANDLE_BYTES = 64
CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600
#: Errors that leave the context unusable until the process exits: ECC uncorrectable, illegal
#: address, launch timeout, context destroyed, device assert, hardware stack, illegal
#: instruction, misaligned address, invalid address space, invalid PC, launch failed.
STICKY = frozenset({214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719})
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_DEVICEMAP = 0x1, 0x2
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST = 2, 1
CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 99
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 0x1, 0x3
BATCH_ABI_VERSION = 12080  # cuMemcpyBatchAsync with failIdx
LIBRARY = "libcuda.so.1"


class MemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes: how the copies of one range of a batch access their operands."""

    _fields_ = [("srcAccessOrder", c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", c_uint)]


class IpcEventHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


#: cuMemcpyBatchAsync at the 12.8 ABI.
BatchFn = ctypes.CFUNCTYPE(c_int, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_size_t), c_size_t,
                           POINTER(MemcpyAttributes), POINTER(c_size_t), c_size_t, POINTER(c_size_t), c_void_p)
HOST_FN = ctypes.CFUNCTYPE(None, c_void_p)  # CUhostFn: void fn(void *user_data)
