"""The order and shape of training observations: Feistel permutation, packing, epoch plans,
and filling one rank's batch into host buffers. numpy only."""
