"""One call: the public allreduce, its plan, the fused buffers' layer tables, and the agreement between ranks."""
