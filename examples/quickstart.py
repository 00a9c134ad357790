# examples/quickstart.py: every rank passes its own two "layers"; Adasum combines each layer separately.
import numpy as np
import adasum

rank, size = adasum.rank(), adasum.size()
orthogonal = np.eye(size)[rank]              # rank r: the r-th unit vector, orthogonal to every other rank's
parallel = (rank + 1) * np.array([1.0, 2.0])  # one direction, a different length on every rank

out = adasum.adasum_allreduce([orthogonal, parallel])  # new arrays, identical on every rank
print(f"rank {rank} of {size}: orthogonal -> {out[0]} (the sum), parallel -> {out[1]} (the mean)", flush=True)

grads = [np.random.default_rng(rank).standard_normal((256, 128)).astype(np.float32)]
adasum.adasum_allreduce_inplace(grads)  # in place, into the rank's own arrays; op="sum" and "mean" work too
