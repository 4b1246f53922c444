"""`python -m bench`: list the bench tool's modules (each is run as `python -m bench.<name>`)."""

import bench

print(bench.__doc__)
