"""The runtime side of ``strategy="auto"``: the operator profiler and what it reads of operators, recompute regions
run under checkpoint, the ranks of a process group agreeing on one plan, and the joint plan applied to a run."""
