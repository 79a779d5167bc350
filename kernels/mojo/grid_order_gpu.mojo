# Programmatic dependent launch (sm_90): how every GPU kernel of ours starts.
#
# kernels/cuda_driver.py may launch a kernel with programmatic stream serialization: its CTAs may
# then be scheduled while the kernel before it on the stream is still finishing, instead of
# after it has drained (the launch and the CTAs' start overlap that kernel's tail: at batch 1 a
# decode step is ~300 kernels of a few microseconds each). Such a kernel must read nothing the
# previous one wrote before `griddepcontrol.wait` returns, which is when that grid has completed
# and its writes are visible; so `grid_order_start` waits first. It then lets the next kernel be
# scheduled early in turn (`launch_dependents`: once every CTA of this grid has passed it). A
# kernel launched without the attribute runs both as no-ops.

from max.gpu.primitives.grid_controls import launch_dependent_grids, wait_on_dependent_grids


@always_inline
def grid_order_start():
    """The first statement of every kernel: wait for the previous grid, release the next."""
    wait_on_dependent_grids()
    launch_dependent_grids()
