"""The Adasum rule without MPI: the pairwise combine, the tree over ranks, the serial reference, the dtype table."""
