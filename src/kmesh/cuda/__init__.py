"""CUDA kernels of KMesh: loading the cubins the `kernels` stage builds, and their argument-checking launchers.

Nothing here imports cupy until a kernel is actually needed, so CPU-only machines import kmesh freely.
"""
from kmesh.cuda.loader import KernelLoadError, configure, kernel_info, load_module

__all__ = ["KernelLoadError", "configure", "kernel_info", "load_module"]
