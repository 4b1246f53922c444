"""``python -m kernels``: the kernel plan table (``kernels.plan.table``), what README.md shows."""

from kernels.plan import table

print(table())
