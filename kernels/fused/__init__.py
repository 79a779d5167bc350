"""Mojo kernels of a decoder layer's fused elementwise ops (mili/engine/model/fused_ops.py).

    checks.py   argument checks shared by both bindings
    cpu.py      CpuFusedKernels: the CPU kernels (kernels/mojo/fused_cpu.mojo, exported by the
                mili_attention extension module)
    ptx.py      ahead-of-time sm_90 PTX of kernels/mojo/fused_gpu.mojo and its manifest
    gpu.py      GpuFusedKernels: loads that PTX and launches it on torch's stream
    backend.py  select_fused_ops: the implementation a choice loads (kernels/choice.py
                decides what a service runs)

Importing this package is cheap (no torch).
"""
