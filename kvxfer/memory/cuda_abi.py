"""The CUDA driver's structures and callback types, as ctypes declares them (``cuda_driver``)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_size_t, c_uint, c_uint64, c_void_p

IPC_HANDLE_BYTES = 64


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
