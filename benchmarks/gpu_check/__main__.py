"""python -m benchmarks.gpu_check: the check (benchmarks/gpu_check/__init__.py says what it runs)."""

from benchmarks.gpu_check import main

if __name__ == "__main__":
    main()
