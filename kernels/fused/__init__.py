"""Mojo kernels of a decoder layer's fused elementwise ops (mili/engine/model/fused_ops.py).

    checks.py   argument checks shared by both bindings
    cpu.py      CpuFusedKernels: the CPU kernels (kernels/mojo/fused_cpu.mojo, exported by the
                mili_attention extension module)
    ptx.py      ahead-of-time sm_90 PTX of kernels/mojo/fused_gpu.mojo and its manifest
    gpu.py      GpuFusedKernels: loads that PTX and launches it on torch's stream

kernels/backend.py's select_fused_ops loads them (kernels/choice.py decides what a service runs).

Importing this package is cheap (no torch).
"""
