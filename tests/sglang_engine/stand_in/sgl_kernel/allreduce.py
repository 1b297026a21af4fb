"""``sgl_kernel.allreduce`` of the stand-in (see the package docstring): imported by SGLang's communicator set-up and
given no names (its custom all-reduce is CUDA-only and never chosen on the CPU)."""
