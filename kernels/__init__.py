"""The book's kernels: CUDA C++ in ``*.cu`` (loaded with ``cudabook.load_cuda``) and their Numba
twins in ``*.py`` (loaded with ``cudabook.load_numba``)."""
