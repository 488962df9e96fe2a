"""``python -m bench.gpu``: see :mod:`bench.gpu.cli`."""

from bench.gpu.cli import main

if __name__ == "__main__":
    main()
