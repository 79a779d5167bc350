"""Mojo kernels of a decoder layer's fused elementwise ops (mili/engine/fused_ops.py).

    checks.py   argument checks shared by both bindings
    cpu.py      CpuFusedKernels: the CPU kernels (kernels/mojo/fused_cpu.mojo, exported by the
                mili_attention extension module)
    backend.py  select_fused_ops: which implementation a service runs

Importing this package is cheap (no torch).
"""
