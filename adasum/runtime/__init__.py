"""The state and the MPI side: the per-communicator context, transport, waiting, the stall inspector, the small exchanges, the launch check, settings, the world and the node topology."""
