"""The CUDA driver, for the GPU kernels' loaders (kernels/gpu.py, kernels/fused/gpu.py): load a
PTX, which the driver JIT-compiles (`cuModuleLoadDataEx`; a failed load reports ptxas's log,
kernels/jit_log.py), and launch one of its functions on a stream (`cuLaunchKernel`) with the
arguments `pack_arguments` lays out from a signature table. A launch with `overlap` goes through
`cuLaunchKernelEx` with programmatic stream serialization: the kernel may be scheduled while
the previous one on the stream finishes, which every kernel of ours allows for by waiting for
that grid first (kernels/mojo/grid_order_gpu.mojo).

The driver is reached through one binding, `cuda.bindings.driver` (cuda-python), imported
lazily on the first launch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from kernels.jit_log import JitLogs

# CUDA's grid limits: both loaders check a launch's grid against them
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 2**31 - 1
# What a function may take without cuFuncSetAttribute raising its limit
_DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024


def _is_null(handle: Any) -> bool:
    return int(handle) == 0


class _CudaPythonDriver:
    """Module loading and launches through cuda-python's driver bindings."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError:  # cuda-python < 12.6 spelled it `cuda.cuda`
            from cuda import cuda as driver
        self.drv = driver
        self._ctx: dict[int, Any] = {}
        self._modules: list[Any] = []
        self._overlap: Any = None  # the launch attribute, made on the first overlapped launch

    def _check(self, result: tuple, what: str, detail: str = "") -> Any:
        """result[1:] of a call that succeeded; else a RuntimeError naming `what`, the error
        and `detail` (a failed JIT's logs)."""
        err = result[0]
        if err != self.drv.CUresult.CUDA_SUCCESS:
            _, msg = self.drv.cuGetErrorString(err)
            text = msg.decode() if isinstance(msg, bytes) else str(msg)
            hint = ""
            if "PTX" in str(err) or "ptx" in text.lower():
                hint = (
                    " (the PTX is ISA 8.5 for sm_90a: the driver must support CUDA >= 12.5 and "
                    "the GPU must be sm_90, i.e. H100/H200)"
                )
            raise RuntimeError(f"{what} failed: {err} {text}{hint}{detail}")
        return result[1] if len(result) == 2 else result[1:]

    def _context(self, device: int) -> Any:
        """The device's primary context (the one torch uses), made current on this thread."""
        ctx = self._ctx.get(device)
        if ctx is None:
            dev = self._check(self.drv.cuDeviceGet(device), "cuDeviceGet")
            ctx = self._check(self.drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self._ctx[device] = ctx
        current = self._check(self.drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is None or _is_null(current) or int(current) != int(ctx):
            self._check(self.drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        return ctx

    def load(self, device: int, ptx: str, entry: str, dynamic_shared: int) -> Any:
        self._context(device)
        image = ctypes.create_string_buffer(ptx.encode())  # NUL-terminated, alive for the call
        logs = JitLogs()  # alive for the call too: the driver writes its logs into it
        options = logs.options()
        result = self.drv.cuModuleLoadDataEx(
            ctypes.addressof(image),
            len(options),
            [getattr(self.drv.CUjit_option, name) for name, _ in options],
            [value for _, value in options],
        )
        module = self._check(result, f"cuModuleLoadDataEx({entry})", logs.describe())
        self._modules.append(module)  # never unloaded: functions live as long as the process
        func = self._check(
            self.drv.cuModuleGetFunction(module, entry.encode()), f"cuModuleGetFunction({entry})"
        )
        if dynamic_shared > _DEFAULT_DYNAMIC_SHARED_LIMIT:
            attr = self.drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self._check(
                self.drv.cuFuncSetAttribute(func, attr, dynamic_shared),
                f"cuFuncSetAttribute({entry}, MAX_DYNAMIC_SHARED_SIZE_BYTES={dynamic_shared})",
            )
        return func

    def launch(
        self,
        device: int,
        func: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        stream: int,
        args: list[ctypes._SimpleCData],
        shared: int,
        overlap: bool = False,
    ) -> None:
        self._context(device)
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        if overlap:
            if self._overlap is None:
                attribute = self.drv.CUlaunchAttribute()
                ids = self.drv.CUlaunchAttributeID
                attribute.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attribute.value.programmaticStreamSerializationAllowed = 1
                self._overlap = attribute
            config = self.drv.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = block
            config.sharedMemBytes = shared
            config.hStream = self.drv.CUstream(stream)
            config.attrs = [self._overlap]
            config.numAttrs = 1
            self._check(
                self.drv.cuLaunchKernelEx(config, func, ctypes.addressof(ptrs), 0),
                "cuLaunchKernelEx (programmatic stream serialization)",
            )
            return
        self._check(
            self.drv.cuLaunchKernel(
                func,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared,  # dynamic shared memory bytes (0: static only)
                self.drv.CUstream(stream),
                ctypes.addressof(ptrs),
                0,
            ),
            "cuLaunchKernel",
        )


def _make_driver() -> _CudaPythonDriver:
    try:
        return _CudaPythonDriver()
    except ImportError as e:
        raise RuntimeError(
            "the GPU kernels need cuda-python (`cuda.bindings.driver`) to load PTX"
        ) from e


def pack_arguments(
    signatures: Mapping[str, Sequence[tuple[str, str]]],
    kernel: str,
    values: dict[str, int | float],
) -> list[ctypes._SimpleCData]:
    """`kernel`'s launch arguments in its entry's parameter order (`signatures`: name ->
    (parameter, "ptr" | "i32" | "f32") pairs, a kernels.signatures or kernels.fused.ptx table)."""
    if set(values) != {name for name, _ in signatures[kernel]}:
        raise AssertionError(f"{kernel}: arguments {sorted(values)} do not match its signature")
    packed: list[ctypes._SimpleCData] = []
    for name, kind in signatures[kernel]:
        value = values[name]
        if kind == "ptr":
            packed.append(ctypes.c_uint64(int(value)))
        elif kind == "i32":
            if not -(2**31) <= int(value) < 2**31:
                raise ValueError(f"{kernel}: {name}={value} does not fit int32")
            packed.append(ctypes.c_int32(int(value)))
        else:
            packed.append(ctypes.c_float(float(value)))
    return packed
