"""The round engine: one sequence of named steps (meta, plan, ingest, admit, allocate,
draw/gather, deliver, feedback, weights) run as three schedules (general, fused, local)."""
