"""The standalone executor: trains a model under a plan on N MPI ranks.

mpiexec -n 4 python -m executor run plan.json --steps 20
"""
