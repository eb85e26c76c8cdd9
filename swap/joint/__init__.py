"""The joint keep / swap / recompute search: for each saved tensor of an iteration, keep it on the device, swap
it to the host, or recompute it in the backward pass, whichever makes the simulated step fastest under the
budget (Note [Joint strategy] in ``search``).

``ops`` (the operator table of one profiled iteration), ``regions`` (checkpointed regions and what they
keep; a region plan applied to a sequence), ``recompute`` (rebuild recipes for elementwise outputs),
``autograd_saves`` (which operators save their own output) and ``search`` (the baseline strategies by name
and the joint search, ``"auto"``). Pure; imports the schedule room (``swap.schedule``) and nothing above it.
"""
