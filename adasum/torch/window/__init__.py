"""The window procedure: micro-batches accumulate in a window (:mod:`.accumulate`); where it closes, the
boundary (:mod:`.boundary`) or local steps (:mod:`.local_steps`, with ``delay=1``) take the local step(s),
the ranks agree on the window once (:mod:`.agreement`), the reduce strategy (:mod:`.reduce`) combines over
the wire (:mod:`.compress`), and the result is applied, the loss scale (:mod:`.amp`) and the module's
buffers (:mod:`.module_buffers`) updated. :mod:`.steps` is the loop that drives it; :mod:`.tensors` the
arithmetic on lists of tensors."""
